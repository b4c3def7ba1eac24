//! The shared transfer secret (`PDSERVE_KV_SECRET`): the reader sends it in its read
//! request, the server compares it in constant time before it looks at anything else.

use subtle::ConstantTimeEq;

/// A shared secret peers prove they know. Its `Debug` never shows the value.
#[derive(Clone, PartialEq, Eq)]
pub struct TransferSecret(String);

impl TransferSecret {
    /// The secret `value`, or `None` when it is empty (no secret configured).
    pub fn new(value: impl Into<String>) -> Option<Self> {
        let value = value.into();
        (!value.is_empty()).then_some(Self(value))
    }

    /// Whether `offered` is this secret. Constant time in the secret's content (only a
    /// length difference returns early), so a client cannot guess it byte by byte.
    pub fn verify(&self, offered: Option<&str>) -> bool {
        offered.is_some_and(|o| bool::from(self.0.as_bytes().ct_eq(o.as_bytes())))
    }

    /// The value, to send to a peer.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for TransferSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferSecret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifies_only_the_exact_secret_and_never_prints_it() {
        assert!(TransferSecret::new("").is_none());
        let s = TransferSecret::new("s3cret").unwrap();
        assert!(s.verify(Some("s3cret")));
        for wrong in [
            None,
            Some(""),
            Some("s3cre"),
            Some("s3cret!"),
            Some("S3cret"),
        ] {
            assert!(!s.verify(wrong), "{wrong:?}");
        }
        assert!(!format!("{s:?}").contains("s3cret"));
    }
}
