//! A thinking model's reply split into its reasoning and its answer, as OpenAI-compatible servers return it
//! (`message.reasoning_content` beside `message.content`; llama.cpp's `--reasoning-format deepseek`, vLLM's reasoning
//! parsers). The reply's think block is recognised at its start only: the open tag first in the reply (after
//! whitespace), or already in the prompt (DeepSeek R1's and QwQ's templates end the generation prompt with it). A
//! reply without one is all answer, byte for byte.

use crate::chat::ThinkTags;

/// How a chat reply's think block is returned (`baton serve --reasoning-format`, a request's `reasoning_format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Left in `content` as the model wrote it.
    None,
    /// In `reasoning_content`, the rest in `content`. llama.cpp's default, `auto`, means the same here.
    #[default]
    Deepseek,
}

impl ReasoningFormat {
    /// The words of the flag and the request field: `none`, `deepseek` or `auto`.
    pub fn parse(s: &str) -> Option<ReasoningFormat> {
        match s {
            "none" => Some(ReasoningFormat::None),
            "deepseek" | "auto" => Some(ReasoningFormat::Deepseek),
            _ => None,
        }
    }
}

/// Text of one step of the split: what goes to `reasoning_content` and what to `content`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the open tag may still come.
    Start,
    /// Inside the think block; `begun` once its leading whitespace is past.
    Reasoning { begun: bool },
    /// Just past the close tag: whitespace before the answer is dropped.
    Closed,
    /// The answer.
    Content,
}

/// Splits a reply given piece by piece. Text is held back only while it may still be (part of) a tag, or
/// whitespace that ends the reasoning or opens the answer (both trimmed, as the models' own templates do when the
/// turn is given back).
#[derive(Clone, Debug)]
pub struct ReasoningSplit {
    tags: ThinkTags,
    state: State,
    held: String,
    found: bool,
}

impl ReasoningSplit {
    /// `prompt_opens`: the prompt ends inside a think block, so the reply starts as reasoning.
    pub fn new(tags: ThinkTags, prompt_opens: bool) -> ReasoningSplit {
        ReasoningSplit {
            tags,
            state: if prompt_opens {
                State::Reasoning { begun: false }
            } else {
                State::Start
            },
            held: String::new(),
            found: prompt_opens,
        }
    }

    /// Whether the reply has a think block (so far).
    pub fn found(&self) -> bool {
        self.found
    }

    /// The next piece of the reply; returns what can be sent now.
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(self.tags.open.as_str()) {
                        self.held = rest.to_string();
                        self.state = State::Reasoning { begun: false };
                        self.found = true;
                    } else if t.is_empty() || self.tags.open.starts_with(t) {
                        return out;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning { begun } => {
                    if !begun {
                        let t = self.held.trim_start();
                        if t.is_empty() {
                            self.held.clear();
                            return out;
                        }
                        self.held = t.to_string();
                        self.state = State::Reasoning { begun: true };
                    }
                    if let Some(i) = self.held.find(self.tags.close.as_str()) {
                        out.reasoning.push_str(self.held[..i].trim_end());
                        self.held.drain(..i + self.tags.close.len());
                        self.state = State::Closed;
                        continue;
                    }
                    // Send all but a possible start of the close tag and the whitespace before it.
                    let cut = self.held.len() - tag_prefix_at_end(&self.held, &self.tags.close);
                    let send = self.held[..cut].trim_end().len();
                    out.reasoning.push_str(&self.held[..send]);
                    self.held.drain(..send);
                    return out;
                }
                State::Closed => {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        self.held.clear();
                        return out;
                    }
                    self.held = t.to_string();
                    self.state = State::Content;
                }
                State::Content => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// The end of the reply: what was held back. A think block never closed (the reply was cut short) is all
    /// reasoning; text that only looked like the start of an open tag is answer.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Start | State::Content => Split {
                content: held,
                ..Default::default()
            },
            State::Reasoning { .. } => Split {
                reasoning: held.trim_end().to_string(),
                ..Default::default()
            },
            State::Closed => Split::default(),
        }
    }

    /// A whole reply at once: its reasoning (`None` without a think block) and its answer.
    pub fn split_all(mut self, text: &str) -> (Option<String>, String) {
        let mut s = self.push(text);
        let end = self.finish();
        s.reasoning.push_str(&end.reasoning);
        s.content.push_str(&end.content);
        (self.found.then_some(s.reasoning), s.content)
    }
}

/// Length of the longest end of `text` that is a proper beginning of `tag` (the tag may be completed by the next
/// piece).
fn tag_prefix_at_end(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .filter(|&k| tag.is_char_boundary(k))
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(prompt_opens: bool) -> ReasoningSplit {
        ReasoningSplit::new(ThinkTags::default(), prompt_opens)
    }

    /// Feeds `pieces` one by one and returns the concatenated reasoning and content, plus whether a block was found.
    fn streamed(prompt_opens: bool, pieces: &[&str]) -> (String, String, bool) {
        let mut s = split(prompt_opens);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let o = s.push(p);
            r += &o.reasoning;
            c += &o.content;
        }
        let o = s.finish();
        (r + &o.reasoning, c + &o.content, s.found())
    }

    #[test]
    fn think_block_then_answer_in_any_pieces() {
        let reply = "<think>\nLet me add.\n2+2 is 4.\n</think>\n\nThe answer is 4.";
        let want = (
            "Let me add.\n2+2 is 4.".to_string(),
            "The answer is 4.".to_string(),
            true,
        );
        assert_eq!(split(false).split_all(reply), (Some(want.0.clone()), want.1.clone()));
        // Every way of cutting the reply into two or three pieces gives the same split.
        let cuts: Vec<usize> = (0..=reply.len()).filter(|&i| reply.is_char_boundary(i)).collect();
        for &a in &cuts {
            for &b in cuts.iter().filter(|&&b| b >= a) {
                let got = streamed(false, &[&reply[..a], &reply[a..b], &reply[b..]]);
                assert_eq!(got, want, "cut at {a}, {b}");
            }
        }
        // Token-sized pieces.
        let pieces = [
            "<",
            "think",
            ">\n",
            "Let",
            " me add.\n2+2 is 4.",
            "\n</",
            "think",
            ">\n\n",
            "The answer is 4.",
        ];
        assert_eq!(streamed(false, &pieces), want);
    }

    #[test]
    fn prompt_that_opens_the_block() {
        // DeepSeek R1 distills: the prompt ends with `<think>\n`, the reply holds only the close tag.
        assert_eq!(
            split(true).split_all("I should greet.\n</think>\n\nHello!"),
            (Some("I should greet.".into()), "Hello!".into())
        );
        // Cut short inside the block: all reasoning, no answer.
        assert_eq!(
            streamed(true, &["Thinking", " more", "\n\n</th"]),
            ("Thinking more\n\n</th".into(), String::new(), true)
        );
    }

    #[test]
    fn replies_without_a_block_are_unchanged() {
        for reply in [
            "Hello <think> there",
            "  plain answer\n",
            "<thin",
            "<",
            "",
            "   ",
            "</think>x",
        ] {
            assert_eq!(split(false).split_all(reply), (None, reply.to_string()), "{reply:?}");
            let pieces: Vec<String> = reply.chars().map(String::from).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(
                streamed(false, &refs),
                (String::new(), reply.to_string(), false),
                "{reply:?}"
            );
        }
        // An empty block (Qwen 3 asked not to think writes one itself sometimes): no reasoning, the answer.
        assert_eq!(
            split(false).split_all("<think>\n\n</think>\n\nHi"),
            (Some(String::new()), "Hi".into())
        );
    }

    #[test]
    fn text_is_sent_as_soon_as_it_cannot_be_a_tag() {
        let mut s = split(false);
        assert_eq!(s.push(" <th"), Split::default());
        assert_eq!(
            s.push("ink>a b"),
            Split {
                reasoning: "a b".into(),
                ..Default::default()
            }
        );
        assert_eq!(
            s.push(" c\n"),
            Split {
                reasoning: " c".into(),
                ..Default::default()
            }
        );
        assert_eq!(s.push("</thi"), Split::default());
        assert_eq!(s.push("nk>\n"), Split::default());
        assert_eq!(
            s.push("\nd"),
            Split {
                content: "d".into(),
                ..Default::default()
            }
        );
        assert_eq!(
            s.push(" </think>"),
            Split {
                content: " </think>".into(),
                ..Default::default()
            }
        );
        // Other tags, multi-byte ones included.
        let tags = ThinkTags {
            open: "\u{25c1}think\u{25b7}".into(),
            close: "\u{25c1}/think\u{25b7}".into(),
        };
        let mut s = ReasoningSplit::new(tags, false);
        assert_eq!(s.push("\u{25c1}think\u{25b7}r\u{25c1}").reasoning, "r");
        assert_eq!(s.push("/think\u{25b7}a").content, "a");
    }

    #[test]
    fn formats_parse() {
        assert_eq!(ReasoningFormat::parse("none"), Some(ReasoningFormat::None));
        assert_eq!(ReasoningFormat::parse("auto"), Some(ReasoningFormat::Deepseek));
        assert_eq!(ReasoningFormat::parse("deepseek"), Some(ReasoningFormat::Deepseek));
        assert_eq!(ReasoningFormat::parse("DeepSeek"), None);
    }
}
