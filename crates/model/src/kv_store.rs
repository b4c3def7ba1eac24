//! Paged KV storage: every layer's keys and values, in fixed blocks of [`BLOCK_SIZE`] tokens.
//!
//! # Block layout
//!
//! Block `b` holds, for tokens `16·b'…16·b'+15` of whichever sequence owns it, the values
//! `[layer][kind][kv_head][slot][dim]` where `kind` is 0 for K (after RoPE) and 1 for V,
//! `slot` is the token's position modulo [`BLOCK_SIZE`], and `dim` runs over `head_dim`.
//! [`KvStore::read_block`] returns exactly those values, in that order, as little-endian
//! numbers of the store's [`KvDtype`] (f16 by default: 2 bytes each). A block written by
//! [`KvStore::write_block`] in another process must come from a store with the same
//! [`KvStore::layout`].

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::config::ModelConfig;
use crate::error::ModelError;

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

/// Index of a block in a [`KvStore`].
pub type BlockId = u32;

/// Number type of stored keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// IEEE half precision: half the memory and transfer bytes.
    #[default]
    F16,
    /// Single precision, exactly what the forward pass computes.
    F32,
}

impl KvDtype {
    /// Bytes of one stored value.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

/// Element types the store can hold, with conversion to and from the f32 compute type.
pub(crate) trait KvElement: Copy + Send + Sync + 'static {
    /// Converts `src` into `dst` (same length).
    fn load(src: &[Self], dst: &mut [f32]);
    /// Converts `src` into `dst` (same length).
    fn store(src: &[f32], dst: &mut [Self]);
    /// Eight values at `p` as f32 lanes.
    ///
    /// # Safety
    /// Eight values are readable at `p`; the CPU has AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElement for f32 {
    fn load(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl KvElement for f16 {
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

pub(crate) enum KvData {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

/// Where values sit inside the flat storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KvGeometry {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvGeometry {
    /// Values of one head's K (or V) for one block.
    pub fn head_stride(&self) -> usize {
        BLOCK_SIZE * self.head_dim
    }
    /// Values of one layer in one block (K and V, all heads).
    pub fn layer_stride(&self) -> usize {
        2 * self.num_kv_heads * self.head_stride()
    }
    /// Values of one block.
    pub fn block_elems(&self) -> usize {
        self.num_layers * self.layer_stride()
    }
    /// Offset of `[block][layer][kind][head][slot 0][0]`.
    pub fn offset(&self, block: usize, layer: usize, kind: usize, head: usize) -> usize {
        block * self.block_elems()
            + layer * self.layer_stride()
            + (kind * self.num_kv_heads + head) * self.head_stride()
    }
}

/// KV storage for every layer, in fixed blocks of [`BLOCK_SIZE`] tokens.
pub struct KvStore {
    geometry: KvGeometry,
    num_blocks: usize,
    dtype: KvDtype,
    pub(crate) data: KvData,
}

impl KvStore {
    /// A store of `num_blocks` zeroed f16 blocks shaped for `config`.
    pub fn new(config: &ModelConfig, num_blocks: usize) -> Self {
        Self::with_dtype(config, num_blocks, KvDtype::F16)
    }

    /// A store of `num_blocks` zeroed blocks of the given number type.
    pub fn with_dtype(config: &ModelConfig, num_blocks: usize, dtype: KvDtype) -> Self {
        let geometry = KvGeometry {
            num_layers: config.num_layers,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        };
        let len = geometry.block_elems() * num_blocks;
        let data = match dtype {
            KvDtype::F16 => KvData::F16(vec![f16::ZERO; len]),
            KvDtype::F32 => KvData::F32(vec![0.0; len]),
        };
        Self {
            geometry,
            num_blocks,
            dtype,
            data,
        }
    }

    /// Bytes a store of `num_blocks` blocks would take, for sizing a pool from a memory budget.
    pub fn bytes_for(config: &ModelConfig, num_blocks: usize, dtype: KvDtype) -> usize {
        2 * config.num_layers
            * config.num_kv_heads
            * config.head_dim
            * BLOCK_SIZE
            * dtype.size()
            * num_blocks
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Number type of the stored values.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Size in bytes of one block as `read_block` returns it.
    pub fn block_bytes(&self) -> usize {
        self.geometry.block_elems() * self.dtype.size()
    }

    /// Bytes of KV one token takes (all layers, K and V).
    pub fn bytes_per_token(&self) -> usize {
        self.block_bytes() / BLOCK_SIZE
    }

    /// A string naming the block format (number type and shape); two stores can exchange
    /// blocks exactly when their layouts are equal.
    pub fn layout(&self) -> String {
        format!(
            "{}:layers={}:kv_heads={}:head_dim={}:block={BLOCK_SIZE}",
            match self.dtype {
                KvDtype::F16 => "f16",
                KvDtype::F32 => "f32",
            },
            self.geometry.num_layers,
            self.geometry.num_kv_heads,
            self.geometry.head_dim
        )
    }

    pub(crate) fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    pub(crate) fn check_block(&self, id: BlockId) -> Result<usize, ModelError> {
        let b = id as usize;
        if b >= self.num_blocks {
            return Err(ModelError::InvalidInput(format!(
                "block {id} out of range (store has {} blocks)",
                self.num_blocks
            )));
        }
        Ok(b)
    }

    /// One block's K and V for all layers, serialized (see the module docs for the layout).
    ///
    /// # Panics
    /// If `id` is not a block of this store.
    pub fn read_block(&self, id: BlockId) -> Vec<u8> {
        let mut out = vec![0u8; self.block_bytes()];
        self.read_block_into(id, &mut out)
            .expect("read_block: block id out of range");
        out
    }

    /// Serializes one block into `out` (`block_bytes()` long).
    pub fn read_block_into(&self, id: BlockId, out: &mut [u8]) -> Result<(), ModelError> {
        let b = self.check_block(id)?;
        if out.len() != self.block_bytes() {
            return Err(ModelError::InvalidInput(format!(
                "block buffer is {} bytes, a block is {}",
                out.len(),
                self.block_bytes()
            )));
        }
        let n = self.geometry.block_elems();
        let range = b * n..(b + 1) * n;
        match &self.data {
            KvData::F16(v) => {
                for (dst, x) in out.chunks_exact_mut(2).zip(&v[range]) {
                    dst.copy_from_slice(&x.to_le_bytes());
                }
            }
            KvData::F32(v) => {
                for (dst, x) in out.chunks_exact_mut(4).zip(&v[range]) {
                    dst.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        Ok(())
    }

    /// Overwrites one block from bytes produced by `read_block` (possibly in another process).
    pub fn write_block(&mut self, id: BlockId, bytes: &[u8]) -> Result<(), ModelError> {
        let b = self.check_block(id)?;
        if bytes.len() != self.block_bytes() {
            return Err(ModelError::InvalidInput(format!(
                "block data is {} bytes, a block of layout {} is {}",
                bytes.len(),
                self.layout(),
                self.block_bytes()
            )));
        }
        let n = self.geometry.block_elems();
        let range = b * n..(b + 1) * n;
        match &mut self.data {
            KvData::F16(v) => {
                for (x, src) in v[range].iter_mut().zip(bytes.chunks_exact(2)) {
                    *x = f16::from_le_bytes([src[0], src[1]]);
                }
            }
            KvData::F32(v) => {
                for (x, src) in v[range].iter_mut().zip(bytes.chunks_exact(4)) {
                    *x = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
                }
            }
        }
        Ok(())
    }

    /// Copies block `src` over block `dst` (copy-on-write of a shared prefix block).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), ModelError> {
        let s = self.check_block(src)?;
        let d = self.check_block(dst)?;
        let n = self.geometry.block_elems();
        match &mut self.data {
            KvData::F16(v) => v.copy_within(s * n..(s + 1) * n, d * n),
            KvData::F32(v) => v.copy_within(s * n..(s + 1) * n, d * n),
        }
        Ok(())
    }
}

/// Writes one token's K and V (`kv_dim` values each, heads concatenated) of one layer.
pub(crate) fn store_token<T: KvElement>(
    data: &mut [T],
    g: &KvGeometry,
    block: usize,
    slot: usize,
    layer: usize,
    k: &[f32],
    v: &[f32],
) {
    let hd = g.head_dim;
    for head in 0..g.num_kv_heads {
        let at = g.offset(block, layer, 0, head) + slot * hd;
        T::store(&k[head * hd..(head + 1) * hd], &mut data[at..at + hd]);
        let at = g.offset(block, layer, 1, head) + slot * hd;
        T::store(&v[head * hd..(head + 1) * hd], &mut data[at..at + hd]);
    }
}
