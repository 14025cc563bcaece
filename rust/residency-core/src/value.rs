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

/// Whether the last materialisation of a value may be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recoverability {
    Reconstructible,
    MustPreserve,
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
