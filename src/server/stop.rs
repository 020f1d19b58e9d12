//! Stop strings over a stream of pieces: text that could still become a stop string is held back, so the client
//! never sees the beginning of a stop string that then matches (OpenAI and llama-server behave the same way).

use crate::generate::Piece;

/// Filters generated pieces against a list of stop strings.
pub struct StopFilter {
    stops: Vec<String>,
    /// Pieces received but not yet released, and their concatenated text.
    held: Vec<Piece>,
    held_text: String,
    matched: bool,
}

impl StopFilter {
    pub fn new(stops: Vec<String>) -> StopFilter {
        StopFilter {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: Vec::new(),
            held_text: String::new(),
            matched: false,
        }
    }

    /// True once a stop string matched: generation should end.
    pub fn matched(&self) -> bool {
        self.matched
    }

    /// Takes one piece, returns the pieces that are now safe to send (whole pieces, or the part of the last one
    /// before a stop string).
    pub fn push(&mut self, piece: Piece) -> Vec<Piece> {
        if self.matched {
            return Vec::new();
        }
        if self.stops.is_empty() {
            return vec![piece];
        }
        self.held_text.push_str(&piece.text);
        self.held.push(piece);
        // A full match: release everything before it, truncating the piece it starts in.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held_text.find(s.as_str())).min() {
            self.matched = true;
            return self.release_upto(at, true);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let n = self.held_text.len();
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held_text, s))
            .max()
            .unwrap_or(0);
        self.release_upto(n - hold, false)
    }

    /// The held pieces at the end of generation (no stop string can match any more).
    pub fn finish(&mut self) -> Vec<Piece> {
        if self.matched {
            return Vec::new();
        }
        self.held_text.clear();
        std::mem::take(&mut self.held)
    }

    /// Releases the pieces that end at or before byte `at` of the held text; with `cut`, also the part of the piece
    /// that straddles `at`, truncated (its token and logprobs kept: the token was generated).
    fn release_upto(&mut self, at: usize, cut: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut end = 0;
        while let Some(p) = self.held.first() {
            let len = p.text.len();
            if end + len <= at {
                end += len;
                out.push(self.held.remove(0));
            } else {
                if cut && at > end {
                    let mut p = self.held.remove(0);
                    p.text.truncate(at - end);
                    end = at;
                    out.push(p);
                }
                break;
            }
        }
        self.held_text.drain(..end);
        if cut {
            self.held.clear();
            self.held_text.clear();
        }
        out
    }
}

/// Length in bytes of the longest proper prefix of `stop` that `text` ends with (on a character boundary).
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k) && stop.as_bytes().starts_with(&text.as_bytes()[text.len() - k..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(t: &str) -> Piece {
        Piece {
            text: t.into(),
            token: Some(1),
            logprob: Some(-0.5),
            top: Vec::new(),
        }
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut f = StopFilter::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            for r in f.push(piece(p)) {
                out.push_str(&r.text);
            }
            if f.matched() {
                break;
            }
        }
        for r in f.finish() {
            out.push_str(&r.text);
        }
        (out, f.matched())
    }

    #[test]
    fn no_stops_passes_everything() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn stop_inside_one_piece_cuts_it() {
        assert_eq!(run(&["END"], &["hello", " wENDx", "more"]), ("hello w".into(), true));
    }

    #[test]
    fn stop_across_pieces_is_never_shown() {
        let mut f = StopFilter::new(vec!["\n\n".into()]);
        assert_eq!(f.push(piece("one\n")).len(), 0, "a possible stop prefix is held");
        let out = f.push(piece("\ntwo"));
        let text: String = out.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(
            text, "one",
            "the text before the stop string, cut inside the held piece"
        );
        assert!(f.matched());
    }

    #[test]
    fn held_text_is_released_when_it_cannot_match() {
        let mut f = StopFilter::new(vec!["abc".into()]);
        assert!(f.push(piece("xab")).is_empty());
        let out = f.push(piece("d"));
        let text: String = out.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(text, "xabd");
        assert!(!f.matched());
    }

    #[test]
    fn earliest_of_several_stops_wins_and_held_tail_flushes_at_end() {
        assert_eq!(run(&["zz", "b"], &["a", "bzz"]), ("a".into(), true));
        assert_eq!(run(&["xyz"], &["ab", "xy"]), ("abxy".into(), false));
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
        assert_eq!(longest_suffix_prefix("caé", "éx"), 2);
    }
}
