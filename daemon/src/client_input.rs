//! Client input repeated in an error message, cut short. A gRPC status travels in HTTP/2
//! trailers, which clients cap (8 KiB by default in several stacks): an error that quoted a
//! 20,000-byte argument whole reached the client as a protocol error, not as the status that
//! said what was wrong. Text for a peer that keeps only so many bytes (the kubelet's DRA
//! health message, the API server's Event note) is cut the same way.

/// The longest part of an argument repeated.
const KEPT: usize = 64;

/// `s` quoted as `{:?}` does, cut to its first 64 characters with its length said after.
pub fn quoted(s: &str) -> String {
    match s.char_indices().nth(KEPT) {
        None => format!("{s:?}"),
        Some((at, _)) => format!("{:?}… ({} bytes)", &s[..at], s.len()),
    }
}

/// `s` cut to at most `max` bytes (at least 3), ending in "..." where it was cut, on a character
/// boundary.
pub fn cut_to(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max - 3;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
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

    #[test]
    fn text_is_cut_to_its_bytes_on_a_character_boundary() {
        assert_eq!(cut_to("short".into(), 8), "short");
        assert_eq!(cut_to("exactly8".into(), 8), "exactly8");
        assert_eq!(cut_to("nine byte".into(), 8), "nine ...");
        // "é" is two bytes: the cut steps back to the character's start.
        assert_eq!(cut_to("aaéééé".into(), 6), "aa...");
    }
}
