//! Frames: a 12-byte header (magic, version, kind, length) and a bounded payload.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::TransferError;

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"PDKV";
/// Protocol version this build speaks.
pub const VERSION: u8 = 1;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 12;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Client → server: JSON [`crate::ReadRequest`].
    ReadRequest = 1,
    /// Server → client: JSON [`crate::ReadAccepted`], followed by the block frames.
    ReadAccepted = 2,
    /// Server → client: `u32` block index (little endian) then the block's bytes.
    Block = 3,
    /// Client → server: every block arrived intact; the server may free them.
    ReadComplete = 4,
    /// Either way: JSON [`crate::message::ErrorMessage`]; the connection then closes.
    Error = 5,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::ReadRequest,
            2 => Self::ReadAccepted,
            3 => Self::Block,
            4 => Self::ReadComplete,
            5 => Self::Error,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub kind: FrameKind,
    pub payload: Vec<u8>,
}

/// Writes one frame whose payload is the concatenation of `parts`.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    parts: &[&[u8]],
) -> Result<(), TransferError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len = u32::try_from(len)
        .map_err(|_| TransferError::Protocol(format!("frame of {len} bytes is too large")))?;
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&MAGIC);
    header[4] = VERSION;
    header[5] = kind as u8;
    header[8..12].copy_from_slice(&len.to_le_bytes());
    w.write_all(&header).await?;
    for p in parts {
        w.write_all(p).await?;
    }
    Ok(())
}

/// Reads one frame, refusing payloads over `max_payload` bytes before allocating them.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_payload: usize,
) -> Result<Frame, TransferError> {
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header).await.map_err(truncated)?;
    if header[..4] != MAGIC {
        return Err(TransferError::Protocol(format!(
            "bad magic {:02x?} (not a pdserve KV peer?)",
            &header[..4]
        )));
    }
    if header[4] != VERSION {
        return Err(TransferError::Protocol(format!(
            "unsupported protocol version {} (this build speaks {VERSION})",
            header[4]
        )));
    }
    let kind = FrameKind::from_u8(header[5])
        .ok_or_else(|| TransferError::Protocol(format!("unknown frame kind {}", header[5])))?;
    let len = u32::from_le_bytes([header[8], header[9], header[10], header[11]]) as usize;
    if len > max_payload {
        return Err(TransferError::Protocol(format!(
            "frame of {len} bytes exceeds the limit of {max_payload}"
        )));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await.map_err(truncated)?;
    Ok(Frame { kind, payload })
}

fn truncated(e: std::io::Error) -> TransferError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        TransferError::Protocol("connection closed in the middle of a frame".into())
    } else {
        TransferError::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn round_trip_and_rejections() {
        let mut buf = Vec::new();
        write_frame(&mut buf, FrameKind::Block, &[b"ab", b"cd"])
            .await
            .unwrap();
        let f = read_frame(&mut buf.as_slice(), 16).await.unwrap();
        assert_eq!(f.kind, FrameKind::Block);
        assert_eq!(f.payload, b"abcd");

        let err = read_frame(&mut buf.as_slice(), 3).await.unwrap_err();
        assert!(err.to_string().contains("exceeds the limit"), "{err}");
        let err = read_frame(&mut &buf[..HEADER_LEN + 1], 16)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("middle of a frame"), "{err}");
        let err = read_frame(&mut &b"GET / HTTP/1.1\r\n"[..], 16)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("bad magic"), "{err}");
        let mut bad = buf.clone();
        bad[4] = 9;
        let err = read_frame(&mut bad.as_slice(), 16).await.unwrap_err();
        assert!(err.to_string().contains("version 9"), "{err}");
        bad = buf.clone();
        bad[5] = 77;
        let err = read_frame(&mut bad.as_slice(), 16).await.unwrap_err();
        assert!(err.to_string().contains("kind 77"), "{err}");
    }
}
