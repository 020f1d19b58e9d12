//! Codepoint classes and the GPT-2 byte-to-unicode mapping, as llama.cpp's unicode.cpp uses them.
//!
//! llama.cpp classifies each codepoint by its general category (one flag per major class, `Cn` being
//! "undefined") plus a separate White_Space set. The categories come from the `unicode-general-category`
//! crate (Unicode 16); llama.cpp's generated table is Unicode 15.x, so only codepoints assigned in 16.0 can
//! be classified differently.

use std::sync::OnceLock;
use unicode_general_category::{GeneralCategory as Gc, get_general_category};

/// Category flags, bit-compatible with llama.cpp's `unicode_cpt_flags` (only the bits the splitters read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flags(u16);

impl Flags {
    pub const UNDEFINED: u16 = 0x0001;
    pub const NUMBER: u16 = 0x0002;
    pub const LETTER: u16 = 0x0004;
    pub const SEPARATOR: u16 = 0x0008;
    pub const ACCENT_MARK: u16 = 0x0010;
    pub const PUNCTUATION: u16 = 0x0020;
    pub const SYMBOL: u16 = 0x0040;
    pub const CONTROL: u16 = 0x0080;
    pub const WHITESPACE: u16 = 0x0100;

    /// The flags of a position outside the current segment: all clear (llama.cpp's `unicode_cpt_flags{}`).
    pub const OUT_OF_RANGE: Flags = Flags(0);

    pub fn of(c: char) -> Flags {
        let cat = match get_general_category(c) {
            Gc::UppercaseLetter | Gc::LowercaseLetter | Gc::TitlecaseLetter | Gc::ModifierLetter | Gc::OtherLetter => {
                Self::LETTER
            }
            Gc::NonspacingMark | Gc::SpacingMark | Gc::EnclosingMark => Self::ACCENT_MARK,
            Gc::DecimalNumber | Gc::LetterNumber | Gc::OtherNumber => Self::NUMBER,
            Gc::ConnectorPunctuation
            | Gc::DashPunctuation
            | Gc::OpenPunctuation
            | Gc::ClosePunctuation
            | Gc::InitialPunctuation
            | Gc::FinalPunctuation
            | Gc::OtherPunctuation => Self::PUNCTUATION,
            Gc::MathSymbol | Gc::CurrencySymbol | Gc::ModifierSymbol | Gc::OtherSymbol => Self::SYMBOL,
            Gc::SpaceSeparator | Gc::LineSeparator | Gc::ParagraphSeparator => Self::SEPARATOR,
            Gc::Control | Gc::Format | Gc::Surrogate | Gc::PrivateUse => Self::CONTROL,
            // Unassigned, and any category a later crate version might add.
            _ => Self::UNDEFINED,
        };
        let ws = if is_white_space(c) { Self::WHITESPACE } else { 0 };
        Flags(cat | ws)
    }

    #[cfg(test)]
    pub fn bits(self) -> u16 {
        self.0
    }
    pub fn is_letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }
    pub fn is_number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }
    pub fn is_whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }
    /// Any flag at all: false only for positions outside the segment.
    pub fn any(self) -> bool {
        self.0 != 0
    }
}

/// The Unicode White_Space property (what Python's `regex` `\s` matches, which is how llama.cpp built its
/// whitespace set). It is a fixed list of 25 codepoints, not a category, so no crate is needed for it.
pub fn is_white_space(c: char) -> bool {
    matches!(
        c as u32,
        0x09..=0x0D
            | 0x20
            | 0x85
            | 0xA0
            | 0x1680
            | 0x2000..=0x200A
            | 0x2028
            | 0x2029
            | 0x202F
            | 0x205F
            | 0x3000
    )
}

/// GPT-2's reversible byte-to-unicode table: printable Latin-1 bytes map to themselves, the other 68 bytes
/// to U+0100.. in byte order.
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        table[b as usize] = char::from_u32(cp).expect("GPT-2 byte table stays below U+0144");
    }
    table
}

/// Inverse of [`byte_to_char_table`]: the byte a mapped char stands for.
pub fn char_to_byte(c: char) -> Option<u8> {
    static INVERSE: OnceLock<[i16; 0x144]> = OnceLock::new();
    let inv = INVERSE.get_or_init(|| {
        let mut inv = [-1i16; 0x144];
        for (b, &c) in byte_to_char_table().iter().enumerate() {
            inv[c as usize] = b as i16;
        }
        inv
    });
    let v = *inv.get(c as usize)?;
    u8::try_from(v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_round_trips_and_matches_gpt2() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'\t' as usize], 'ĉ');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xAD], 'Ń');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[b as usize]), Some(b));
        }
        assert_eq!(char_to_byte('€'), None);
    }

    #[test]
    fn flags_follow_categories() {
        assert!(Flags::of('a').is_letter());
        assert!(Flags::of('日').is_letter());
        assert!(Flags::of('7').is_number());
        assert!(Flags::of('²').is_number());
        assert!(Flags::of('½').is_number());
        assert!(Flags::of(' ').is_whitespace());
        assert!(Flags::of('\n').is_whitespace());
        assert!(Flags::of('\u{3000}').is_whitespace());
        assert!(!Flags::of('\u{200B}').is_whitespace()); // zero-width space is Cf, not White_Space
        assert_eq!(Flags::of('\u{200B}').bits(), Flags::CONTROL);
        assert_eq!(Flags::of('\u{0378}').bits(), Flags::UNDEFINED);
        assert_eq!(Flags::of('😀').bits(), Flags::SYMBOL);
        assert_eq!(Flags::of('\u{0301}').bits(), Flags::ACCENT_MARK);
        assert!(Flags::of('x').any());
        assert!(!Flags::OUT_OF_RANGE.any());
    }
}
