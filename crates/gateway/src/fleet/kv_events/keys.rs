//! The gateway's own keys for KV blocks: each block's tokens hashed after its parent's
//! key, so equal keys mean equal prefixes whatever the engine's hashes are; and a prompt's
//! keys, computed once per block size for a routing decision.

use std::hash::{BuildHasher, Hash, Hasher};

/// The gateway's key for a block: its tokens hashed after its parent's key, so equal keys
/// mean equal prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockKey(pub u64);

impl BlockKey {
    /// The key of a block of `tokens` following the block keyed `parent`.
    pub fn chain(parent: Option<BlockKey>, tokens: &[u32]) -> Self {
        // A fixed seed: every gateway process of this build keys alike. foldhash, not
        // SipHash: an 8k-token prompt is 32 KiB to hash on every routing decision, and
        // SipHash took about 20 µs of it.
        let mut h = foldhash::fast::FixedState::with_seed(BLOCK_KEY_SEED).build_hasher();
        parent.map(|p| p.0).hash(&mut h);
        tokens.hash(&mut h);
        BlockKey(h.finish())
    }
}

/// The seed of [`BlockKey::chain`]'s hasher.
const BLOCK_KEY_SEED: u64 = 0x7064_7365_7276_6531;

/// A prompt's block keys, computed once for each block size asked, however many
/// workers' indexes are read with them.
#[derive(Debug)]
pub struct PromptKeys<'a> {
    tokens: &'a [u32],
    computed: Vec<(usize, Vec<BlockKey>)>,
}

impl<'a> PromptKeys<'a> {
    /// The keys of `tokens`, none computed yet.
    pub fn new(tokens: &'a [u32]) -> Self {
        Self {
            tokens,
            computed: Vec::new(),
        }
    }

    /// The prompt's tokens.
    pub fn tokens(&self) -> &'a [u32] {
        self.tokens
    }

    /// The keys of the prompt's full blocks of `block_size` tokens, in order.
    pub fn get(&mut self, block_size: usize) -> &[BlockKey] {
        let at = match self.computed.iter().position(|(s, _)| *s == block_size) {
            Some(at) => at,
            None => {
                self.computed
                    .push((block_size, prompt_keys(self.tokens, block_size)));
                self.computed.len() - 1
            }
        };
        &self.computed[at].1
    }
}

impl PromptKeys<'_> {
    /// The keys for `block_size` if [`Self::get`] computed them.
    pub fn computed(&self, block_size: usize) -> Option<&[BlockKey]> {
        self.computed
            .iter()
            .find(|(s, _)| *s == block_size)
            .map(|(_, keys)| keys.as_slice())
    }
}

/// The keys of every full block of `tokens`, in order.
pub fn prompt_keys(tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    let mut keys = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let key = BlockKey::chain(parent, block);
        keys.push(key);
        parent = Some(key);
    }
    keys
}
