//! AVX2 kernel for one panel of 8 repacked weight rows (see [`crate::quant_matmul`]).
//!
//! Per block column: one F16C load gives the panel's 8 scales (and 8 minimums for Q4_1);
//! each row's 32 quants meet the activation block in `maddubs`/`madd`, and a `hadd` tree
//! turns the 8 rows' partial sums into one vector holding each row's exact integer dot
//! product. One multiply and one FMA then scale and accumulate all 8 rows, where a
//! row-at-a-time kernel needs a broadcast, a multiply, a conversion and an FMA per row.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::act_block::ActBlock;

/// Products of one panel (8 rows, `nb` blocks, Q8_0 when `Q8`, Q4_1 otherwise) with `G`
/// activation rows (`nb` blocks apart in `acts`): `[act][row]`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `panel` points at `nb` panel blocks; `acts` holds
/// `G * nb` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn panel_avx2<const Q8: bool, const G: usize>(
    panel: *const u8,
    acts: &[ActBlock],
    nb: usize,
) -> [[f32; 8]; G] {
    debug_assert!(acts.len() >= G * nb);
    // Per panel block: 8 scales (16 bytes), Q4_1's 8 minimums (16), 8 rows of quants.
    let (head, body) = if Q8 { (16, 32) } else { (32, 16) };
    let block = head + 8 * body;
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); G];
    let mut offs = [_mm256_setzero_ps(); G];
    let mut qw = [_mm256_setzero_si256(); 8];
    let mut signs = [_mm256_setzero_si256(); 8];
    for b in 0..nb {
        let pb = panel.add(b * block);
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(pb as *const __m128i));
        let mw = if Q8 {
            _mm256_setzero_ps()
        } else {
            _mm256_cvtph_ps(_mm_loadu_si128(pb.add(16) as *const __m128i))
        };
        let qs = pb.add(head);
        // Unsigned operands for maddubs (and, for Q8_0, the signs to move onto the
        // activations): kept across the tile's activation rows.
        for r in 0..8 {
            if Q8 {
                let q = _mm256_loadu_si256(qs.add(r * body) as *const __m256i);
                qw[r] = _mm256_sign_epi8(q, q);
                signs[r] = q;
            } else {
                // Element j is the low nibble of byte j, element j+16 its high nibble.
                let packed = _mm_loadu_si128(qs.add(r * body) as *const __m128i);
                qw[r] = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                    low_nibbles,
                );
            }
        }
        for g in 0..G {
            let ab = acts.get_unchecked(g * nb + b);
            let qa = _mm256_load_si256(ab.qs.as_ptr() as *const __m256i);
            // u8 × i8 pairs summed to i16 (|w| ≤ 128, |a| ≤ 127: no saturation), then i32.
            let dot = |r: usize| {
                let a = if Q8 {
                    _mm256_sign_epi8(qa, signs[r])
                } else {
                    qa
                };
                _mm256_madd_epi16(_mm256_maddubs_epi16(qw[r], a), ones)
            };
            // Lanes of each 128-bit half: rows 0-3 (then 4-7), each half's partial sum.
            let s0123 = _mm256_hadd_epi32(
                _mm256_hadd_epi32(dot(0), dot(1)),
                _mm256_hadd_epi32(dot(2), dot(3)),
            );
            let s4567 = _mm256_hadd_epi32(
                _mm256_hadd_epi32(dot(4), dot(5)),
                _mm256_hadd_epi32(dot(6), dot(7)),
            );
            let isum = _mm256_add_epi32(
                _mm256_permute2x128_si256(s0123, s4567, 0x20),
                _mm256_permute2x128_si256(s0123, s4567, 0x31),
            );
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(ab.d));
            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[g]);
            if !Q8 {
                offs[g] = _mm256_fmadd_ps(mw, _mm256_set1_ps(ab.s), offs[g]);
            }
        }
    }
    let mut out = [[0f32; 8]; G];
    for g in 0..G {
        _mm256_storeu_ps(out[g].as_mut_ptr(), _mm256_add_ps(acc[g], offs[g]));
    }
    out
}
