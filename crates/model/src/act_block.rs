//! The activation side of the quantized matmul: one block of 8-bit activations, as the
//! portable code writes it and the AVX2 kernel reads it.

/// Values per quantized block (weights and activations alike).
pub(crate) const QK: usize = 32;

/// One block of 8-bit activations.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub(crate) struct ActBlock {
    /// Quantized values.
    pub(crate) qs: [i8; QK],
    /// Scale.
    pub(crate) d: f32,
    /// `d · Σ qs`.
    pub(crate) s: f32,
}
