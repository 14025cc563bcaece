//! What the core knows about a managed value: its byte counts and two flags.
//!
//! Every materialisation of a value is charged the full `storage_nbytes`, which is
//! also the ceiling on the actual storage a measured value may occupy.

use crate::error::{CoreError, CoreResult};

/// Whether a value may have several simultaneous materialisations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaMode {
    Replicable,
    Exclusive,
}

impl ReplicaMode {
    pub fn of(exclusive: bool) -> Self {
        if exclusive {
            Self::Exclusive
        } else {
            Self::Replicable
        }
    }
}

/// Whether the last materialisation of a value may be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recoverability {
    Reconstructible,
    MustPreserve,
}

/// The charge rule: a materialisation occupies the larger of its logical payload and
/// the storage its tensors hold (docs/concepts/values.md#install). An adopted value's
/// spec is charged this; an installed one may occupy at most its spec's charge.
#[inline]
pub fn charge_of(logical_nbytes: u64, storage_nbytes: u64) -> u64 {
    logical_nbytes.max(storage_nbytes)
}

/// The immutable specification of a managed value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ValueSpec {
    logical_nbytes: u64,
    storage_nbytes: u64,
    replica_mode: ReplicaMode,
    recoverability: Recoverability,
}

impl ValueSpec {
    /// Validates that the storage charge covers the logical payload.
    pub fn new(
        logical_nbytes: u64,
        storage_nbytes: u64,
        replica_mode: ReplicaMode,
        recoverability: Recoverability,
    ) -> CoreResult<Self> {
        if storage_nbytes < logical_nbytes {
            return Err(CoreError::InvalidArgument {
                message: format!(
                    "storage_nbytes ({storage_nbytes}) must be >= logical_nbytes ({logical_nbytes})"
                ),
            });
        }
        Ok(Self {
            logical_nbytes,
            storage_nbytes,
            replica_mode,
            recoverability,
        })
    }

    /// The spec of an adopted value measured at `logical` and `storage` bytes
    /// (docs/concepts/values.md#adopt): it must be preserved, and is charged the charge
    /// rule's bytes (`charge_of`).
    #[inline]
    pub fn adopted(logical: u64, storage: u64, exclusive: bool) -> Self {
        Self {
            logical_nbytes: logical,
            storage_nbytes: charge_of(logical, storage),
            replica_mode: ReplicaMode::of(exclusive),
            recoverability: Recoverability::MustPreserve,
        }
    }

    /// The spec of a registered source's value (docs/concepts/values.md#register-a-source):
    /// reconstructible, with the counts `source_bytes` took.
    pub fn reconstructible(logical: u64, storage: u64, exclusive: bool) -> CoreResult<Self> {
        Self::new(
            logical,
            storage,
            ReplicaMode::of(exclusive),
            Recoverability::Reconstructible,
        )
    }

    pub fn logical_nbytes(&self) -> u64 {
        self.logical_nbytes
    }

    /// The fixed charge every materialisation of this value pays.
    pub fn storage_nbytes(&self) -> u64 {
        self.storage_nbytes
    }

    pub fn replica_mode(&self) -> ReplicaMode {
        self.replica_mode
    }

    pub fn recoverability(&self) -> Recoverability {
        self.recoverability
    }

    pub fn is_exclusive(&self) -> bool {
        self.replica_mode == ReplicaMode::Exclusive
    }
}

/// A byte count of a spec, as messages name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecField {
    Logical,
    Storage,
}

impl SpecField {
    /// The field's attribute on a spec record.
    pub fn attribute(self) -> &'static str {
        match self {
            Self::Logical => "logical_nbytes",
            Self::Storage => "storage_nbytes",
        }
    }

    /// The field as messages name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Logical => "spec.logical_nbytes",
            Self::Storage => "spec.storage_nbytes",
        }
    }
}

/// Why `register_source` refuses a spec before the core sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceRefusal {
    /// The spec's value must be preserved: such values are adopted.
    MustPreserve,
    /// A byte count past 2**64 - 1, which the core cannot account.
    TooManyBytes(SpecField),
}

impl SourceRefusal {
    /// The spec field whose count the refusal's message quotes, if any.
    pub fn field(self) -> Option<SpecField> {
        match self {
            Self::MustPreserve => None,
            Self::TooManyBytes(field) => Some(field),
        }
    }
}

impl ValueSpec {
    /// The byte counts of a spec `register_source` takes (docs/concepts/values.md#register-a-source):
    /// `logical` and `storage` are `None` where past 2**64 - 1. Refused, in this order:
    /// a spec whose value must be preserved, then a logical and a storage count the
    /// core cannot account.
    pub fn source_bytes(
        must_preserve: bool,
        logical: Option<u64>,
        storage: Option<u64>,
    ) -> Result<(u64, u64), SourceRefusal> {
        if must_preserve {
            return Err(SourceRefusal::MustPreserve);
        }
        let logical = logical.ok_or(SourceRefusal::TooManyBytes(SpecField::Logical))?;
        let storage = storage.ok_or(SourceRefusal::TooManyBytes(SpecField::Storage))?;
        Ok((logical, storage))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_must_cover_logical_bytes() {
        let spec = ValueSpec::new(16, 16, ReplicaMode::Exclusive, Recoverability::MustPreserve)
            .expect("equal byte counts are valid");
        assert_eq!(spec.logical_nbytes(), 16);
        assert_eq!(spec.storage_nbytes(), 16);
        assert!(spec.is_exclusive());
        assert!(
            ValueSpec::new(
                0,
                0,
                ReplicaMode::Replicable,
                Recoverability::Reconstructible
            )
            .is_ok()
        );
        let err = ValueSpec::new(
            17,
            16,
            ReplicaMode::Replicable,
            Recoverability::Reconstructible,
        )
        .expect_err("storage below logical is rejected");
        assert!(matches!(err, CoreError::InvalidArgument { .. }));
    }
}

/// The id a manager issues for a value: a random (version 4) UUID, kept as its 128
/// bits (as two words, so the handle index stays 8-byte aligned and compact) and
/// written out in the hyphenated form handles carry.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandleName([u64; 2]);

/// An odd multiplier and its inverse modulo 2**32: consecutive indices land far
/// apart in the id, so issued ids look as random as any other version 4 UUID.
const SCRAMBLE: u32 = 0x9E37_79B1;
const UNSCRAMBLE: u32 = 0x0E8B_2F51;

/// Each byte's value as a lower-case hex digit; 0xFF for every other byte.
const HEX_DIGIT: [u8; 256] = {
    let mut table = [0xFF; 256];
    let mut digit = 0u8;
    while digit < 16 {
        let byte = if digit < 10 {
            b'0' + digit
        } else {
            b'a' + digit - 10
        };
        table[byte as usize] = digit;
        digit += 1;
    }
    table
};

impl HandleName {
    /// A fresh random id that also carries `index`, scrambled under the manager's
    /// `key`, in 32 of its random bits: looking a handle up by its id then needs no
    /// index of names (a million handles would pay for one in memory), only a check
    /// that the record at that index carries this very id.
    pub fn issue(index: u32, key: u32) -> Self {
        let mut name = Self::from_u128(uuid::Uuid::new_v4().as_u128());
        let scrambled = index.wrapping_mul(SCRAMBLE) ^ key;
        name.0[1] = (name.0[1] & !u64::from(u32::MAX)) | u64::from(scrambled);
        name
    }

    /// The index an id written as `text` would carry under `key`, read from its
    /// last eight hex digits alone; `None` if those are not lower-case hex digits.
    /// The caller still checks the whole text against the id issued at that index.
    pub fn index_in_text(text: &str, key: u32) -> Option<u32> {
        let bytes = text.as_bytes();
        if bytes.len() != 36 {
            return None;
        }
        // Every handle lookup reads these digits: by table, without a branch per digit.
        let mut scrambled: u32 = 0;
        let mut digits = 0u8;
        for &byte in &bytes[28..] {
            let digit = HEX_DIGIT[usize::from(byte)];
            digits |= digit;
            scrambled = (scrambled << 4) | u32::from(digit & 0xF);
        }
        // A byte that is no lower-case hex digit reads with its high bits set.
        (digits & 0xF0 == 0).then(|| (scrambled ^ key).wrapping_mul(UNSCRAMBLE))
    }

    /// Whether `text` is exactly this id's hyphenated lower-case spelling
    /// (`8-4-4-4-12` hex digits). Every handle lookup asks this, so the spelling is
    /// written with a table into a stack buffer and compared in one go.
    pub fn is_written_as(&self, text: &str) -> bool {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        // Where each byte's two digits start: the hyphens sit at 8, 13, 18 and 23.
        const STARTS: [usize; 16] = [0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34];
        let mut written = [b'-'; 36];
        for (&start, byte) in STARTS.iter().zip(self.as_u128().to_be_bytes()) {
            written[start] = DIGITS[usize::from(byte >> 4)];
            written[start + 1] = DIGITS[usize::from(byte & 0xF)];
        }
        written == text.as_bytes()
    }
}

impl HandleName {
    fn from_u128(bits: u128) -> Self {
        // Truncation is the point: the high and low words.
        #[allow(clippy::cast_possible_truncation)]
        Self([(bits >> 64) as u64, bits as u64])
    }

    fn as_u128(self) -> u128 {
        (u128::from(self.0[0]) << 64) | u128::from(self.0[1])
    }

    /// The hyphenated text, written into `buffer` without allocating.
    pub fn encode<'b>(&self, buffer: &'b mut [u8; 36]) -> &'b str {
        uuid::Uuid::from_u128(self.as_u128())
            .hyphenated()
            .encode_lower(buffer)
    }

    /// The id's string (as [`std::fmt::Display`] writes it), shared: one allocation.
    pub fn to_shared_str(&self) -> std::sync::Arc<str> {
        std::sync::Arc::from(self.encode(&mut [0u8; 36]))
    }
}

impl std::fmt::Display for HandleName {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(
            &uuid::Uuid::from_u128(self.as_u128()).hyphenated(),
            formatter,
        )
    }
}

/// Written like the id's string would be: quoted.
impl std::fmt::Debug for HandleName {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "\"{self}\"")
    }
}

#[cfg(test)]
mod handle_name_tests {
    use super::HandleName;

    #[test]
    fn text_round_trips_and_other_spellings_name_nothing() {
        let name = HandleName::issue(41, 0xDEAD_BEEF);
        for index in [0, 1, 2, 1 << 20, u32::MAX] {
            let issued = HandleName::issue(index, 7).to_string();
            assert_eq!(HandleName::index_in_text(&issued, 7), Some(index));
        }
        let parsed = uuid::Uuid::parse_str(&name.to_string()).expect("a UUID");
        assert_eq!(parsed.get_version_num(), 4);
        assert_eq!(parsed.get_variant(), uuid::Variant::RFC4122);
        let mut buffer = [0u8; 36];
        let text = name.encode(&mut buffer).to_owned();
        assert_eq!(text, name.to_string());
        assert_eq!(&*name.to_shared_str(), name.to_string());
        assert_eq!(HandleName::index_in_text(&text, 0xDEAD_BEEF), Some(41));
        assert!(name.is_written_as(&text));
        assert!(!name.is_written_as(&text.to_uppercase()));
        assert!(!name.is_written_as(&text.replace('-', "_")));
        assert!(!name.is_written_as(&text[..35]));
        for index in 0..64 {
            let other = HandleName::issue(index, 3);
            let mut buffer = [0u8; 36];
            let written = other.encode(&mut buffer).to_owned();
            assert!(other.is_written_as(&written));
            assert!(!name.is_written_as(&written));
            // A change in any one position is another spelling.
            for position in 0..36 {
                let mut changed = written.clone().into_bytes();
                changed[position] = if changed[position] == b'0' {
                    b'1'
                } else {
                    b'0'
                };
                let changed = String::from_utf8(changed).expect("ASCII");
                assert!(!other.is_written_as(&changed), "{changed}");
            }
        }
        assert_eq!(format!("{name:?}"), format!("\"{text}\""));
        assert_eq!(
            HandleName::index_in_text(&text.replace('-', ""), 0xDEAD_BEEF),
            None
        );
        assert_eq!(HandleName::index_in_text("handle-1", 0xDEAD_BEEF), None);
        // Any byte of the last eight that is no lower-case hex digit refuses the text.
        for position in 28..36 {
            for wrong in [b'A', b'F', b'g', b'/', b':', b'`', b'-', 0x7F] {
                let mut bytes = text.clone().into_bytes();
                bytes[position] = wrong;
                let wrong = String::from_utf8_lossy(&bytes).into_owned();
                assert_eq!(
                    HandleName::index_in_text(&wrong, 0xDEAD_BEEF),
                    None,
                    "{wrong}"
                );
            }
        }
        assert_ne!(HandleName::issue(41, 0xDEAD_BEEF), name);
    }
}
