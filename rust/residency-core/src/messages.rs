//! The refusals the bindings raise before a call reaches the manager (an argument of
//! the wrong class, a stream where none is taken, a spec `register_source` cannot
//! take), each text written once, here. The bindings fill in the names as the caller
//! writes them (a type's name, a location's, a `repr`) and raise the class `kind` says.

use std::fmt;

use crate::location::Location;
use crate::plan::{Action, ActionKind};
use crate::value::SourceRefusal;

/// Which exception a refusal is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// `TypeError`: an argument of the wrong class.
    Type,
    /// `ValueError`: an argument of the right class that cannot be taken.
    Value,
    /// `ResidencyMaterializationError`: a value of the wrong type for its handle.
    Materialization,
}

/// A refused argument, with the names its message gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal<'a> {
    /// An object given as an action that is none of the four action records.
    NotAnAction { repr: &'a str },
    /// A location argument that is not a `ResidencyLocation` (`got`: its type's name).
    NotALocation { got: &'a str },
    /// A stream argument the runtime does not take for a CUDA stream.
    NotAStream { got: &'a str },
    /// A stream given for a host location.
    StreamForHost { location: &'a str },
    /// A stream on another device than the location's.
    StreamOnOtherDevice { device: &'a str, location: &'a str },
    /// A transfer stream given to an action that copies nothing (drop, discard).
    StreamNotTaken { kind: ActionKind },
    /// `register_source`'s spec argument is not a `ResidencyValueSpec`.
    NotASpec { got: &'a str },
    /// `register_source`'s source has no callable `load()`.
    SourceNotLoadable,
    /// `register_source`'s `source_location` is a disk location.
    SourceOnDisk { location: &'a str },
    /// `register_source` with a spec whose value must be preserved.
    SourceMustPreserve,
    /// A byte count past what the core accounts (`name`: the field, `nbytes`: the
    /// count as the caller wrote it).
    TooManyBytes { name: &'a str, nbytes: &'a str },
    /// `adopt`'s value is not a `TensorResident`; `tensor`: it is a `torch.Tensor`.
    NotTensorResident { got: &'a str, tensor: bool },
    /// `adopt`'s `replica_mode` is not a `ReplicaMode`.
    NotAReplicaMode { got: &'a str },
    /// A value made or loaded for a handle is not of the handle's value type.
    WrongValueType {
        expected: &'a str,
        handle: &'a str,
        got: &'a str,
        tensor: bool,
    },
    /// A plan with more distinct handles than a slot can number.
    TooManyHandles,
}

/// What to do with a tensor passed where a managed value is expected.
const TENSOR_HINT: &str = "wrap a tensor first: fhelium.values.ResidentTensor(tensor) \
     (see docs/concepts/values.md#tensorresident)";

/// What to do with a value that is neither a `TensorResident` nor a tensor.
const WRAP_HINT: &str = "wrap it first: fhelium.values.as_resident(value) takes a tensor, a \
     mapping of names to tensors or a list of tensors (see docs/concepts/values.md#tensorresident)";

impl Refusal<'_> {
    /// The exception class the refusal is raised as.
    pub fn kind(&self) -> RefusalKind {
        match self {
            Self::NotAnAction { .. }
            | Self::NotALocation { .. }
            | Self::NotAStream { .. }
            | Self::NotASpec { .. }
            | Self::SourceNotLoadable
            | Self::NotTensorResident { .. }
            | Self::NotAReplicaMode { .. } => RefusalKind::Type,
            Self::StreamForHost { .. }
            | Self::StreamOnOtherDevice { .. }
            | Self::StreamNotTaken { .. }
            | Self::SourceOnDisk { .. }
            | Self::SourceMustPreserve
            | Self::TooManyBytes { .. }
            | Self::TooManyHandles => RefusalKind::Value,
            Self::WrongValueType { .. } => RefusalKind::Materialization,
        }
    }
}

impl fmt::Display for Refusal<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::NotAnAction { repr } => write!(f, "not a residency action: {repr}"),
            Self::NotALocation { got } => write!(f, "expected a ResidencyLocation, got {got}"),
            Self::NotAStream { got } => write!(f, "stream must be a CUDA stream, got {got}"),
            Self::StreamForHost { location } => {
                write!(f, "a stream was given for host location {location}")
            }
            Self::StreamOnOtherDevice { device, location } => {
                write!(f, "stream is on {device}, but the location is {location}")
            }
            Self::StreamNotTaken { kind } => {
                write!(f, "{} does not take a transfer stream", kind.record_name())
            }
            Self::NotASpec { got } => {
                write!(f, "spec must be a ResidencyValueSpec, got {got}")
            }
            Self::SourceNotLoadable => f.write_str("source must have a callable load() method"),
            Self::SourceOnDisk { location } => write!(
                f,
                "a source loads into memory, so source_location cannot be the disk location \
                 {location}"
            ),
            Self::SourceMustPreserve => f.write_str(
                "register_source requires Recoverability.RECONSTRUCTIBLE; use adopt() for \
                 values that must be preserved",
            ),
            Self::TooManyBytes { name, nbytes } => write!(
                f,
                "{name} of {nbytes} bytes exceeds the supported maximum of 2**64 - 1"
            ),
            Self::NotTensorResident { got, tensor } => write!(
                f,
                "value must be a TensorResident, got {got}; {}",
                if tensor { TENSOR_HINT } else { WRAP_HINT }
            ),
            Self::NotAReplicaMode { got } => {
                write!(f, "replica_mode must be a ReplicaMode, got {got}")
            }
            Self::WrongValueType {
                expected,
                handle,
                got,
                tensor,
            } => {
                write!(f, "expected a {expected} for value {handle}, got {got}")?;
                if tensor {
                    write!(f, "; {TENSOR_HINT}")?;
                }
                Ok(())
            }
            Self::TooManyHandles => f.write_str("a plan names at most 2**32 handles"),
        }
    }
}

impl<'a> Refusal<'a> {
    /// Where the transfer stream given with `action` is checked: the location it
    /// copies to (an ensure's, a move's destination); an action that copies nothing
    /// (a drop, a discard) takes no stream (docs/concepts/transitions.md).
    #[inline]
    pub fn stream_destination(action: &Action) -> Result<Location, Refusal<'static>> {
        action.destination().ok_or(Refusal::StreamNotTaken {
            kind: action.kind(),
        })
    }

    /// The refusal of a spec `register_source` cannot take (`ValueSpec::source_bytes`);
    /// `nbytes` is the count of the field it names (`SourceRefusal::field`) as the
    /// caller wrote it, unused for the others.
    pub fn of_source(refusal: SourceRefusal, nbytes: &'a str) -> Self {
        match refusal {
            SourceRefusal::MustPreserve => Self::SourceMustPreserve,
            SourceRefusal::TooManyBytes(field) => Self::TooManyBytes {
                name: field.name(),
                nbytes,
            },
        }
    }
}

/// The note added to a failed CUDA copy's error when synchronising its stream failed
/// too (docs/concepts/transitions.md): `device` and `error` as the caller writes them.
pub fn cleanup_note(device: &str, error: &str) -> String {
    format!(
        "cleanup after the failed transfer to {device} also failed: copy stream synchronize \
         raised {error}"
    )
}
