//! Client input repeated in an error message, cut short. A gRPC status travels in HTTP/2
//! trailers, which clients cap (8 KiB by default in several stacks): an error that quoted a
//! 20,000-byte argument whole reached the client as a protocol error, not as the status that
//! said what was wrong.

/// The longest part of an argument repeated.
const KEPT: usize = 64;

/// `s` quoted as `{:?}` does, cut to its first 64 characters with its length said after.
pub fn quoted(s: &str) -> String {
    match s.char_indices().nth(KEPT) {
        None => format!("{s:?}"),
        Some((at, _)) => format!("{:?}… ({} bytes)", &s[..at], s.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_input_is_cut_and_its_length_said() {
        assert_eq!(quoted("GPU-7"), "\"GPU-7\"");
        let long = "é".repeat(10_000);
        let q = quoted(&long);
        assert!(q.starts_with(&format!("\"{}\"…", "é".repeat(64))), "{q}");
        assert!(q.ends_with("(20000 bytes)"), "{q}");
        assert!(q.len() < 200);
    }
}
