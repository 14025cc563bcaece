//! The refusal texts the bindings raise, each written once in the core, and the
//! exception class each is raised as.

use residency_core::messages::cleanup_note;
use residency_core::{
    ActionKind, CudaDevices, Location, Refusal, RefusalKind, ReplicaMode, SourceRefusal, SpecField,
    ValueSpec,
};

#[test]
fn stream_refusals_name_the_action_record_class() {
    for (kind, text) in [
        (
            ActionKind::Drop,
            "DropResident does not take a transfer stream",
        ),
        (
            ActionKind::Discard,
            "DiscardValue does not take a transfer stream",
        ),
    ] {
        assert!(!kind.takes_stream());
        let refusal = Refusal::StreamNotTaken { kind };
        assert_eq!(refusal.to_string(), text);
        assert_eq!(refusal.kind(), RefusalKind::Value);
    }
    assert!(ActionKind::Ensure.takes_stream());
    assert!(ActionKind::Move.takes_stream());
}

#[test]
fn argument_classes_are_type_errors_and_unusable_values_value_errors() {
    let cases = [
        (
            Refusal::NotAnAction { repr: "3" },
            RefusalKind::Type,
            "not a residency action: 3",
        ),
        (
            Refusal::NotALocation { got: "str" },
            RefusalKind::Type,
            "expected a ResidencyLocation, got str",
        ),
        (
            Refusal::NotAStream { got: "int" },
            RefusalKind::Type,
            "stream must be a CUDA stream, got int",
        ),
        (
            Refusal::StreamForHost {
                location: "pinned-host",
            },
            RefusalKind::Value,
            "a stream was given for host location pinned-host",
        ),
        (
            Refusal::StreamOnOtherDevice {
                device: "cuda:1",
                location: "cuda:0",
            },
            RefusalKind::Value,
            "stream is on cuda:1, but the location is cuda:0",
        ),
        (
            Refusal::SourceOnDisk {
                location: "disk:/x",
            },
            RefusalKind::Value,
            "a source loads into memory, so source_location cannot be the disk location disk:/x",
        ),
        (
            Refusal::SourceMustPreserve,
            RefusalKind::Value,
            "register_source requires Recoverability.RECONSTRUCTIBLE; use adopt() for values \
             that must be preserved",
        ),
        (
            Refusal::TooManyBytes {
                name: "spec.logical_nbytes",
                nbytes: "18446744073709551616",
            },
            RefusalKind::Value,
            "spec.logical_nbytes of 18446744073709551616 bytes exceeds the supported maximum \
             of 2**64 - 1",
        ),
        (
            Refusal::NotAReplicaMode { got: "str" },
            RefusalKind::Type,
            "replica_mode must be a ReplicaMode, got str",
        ),
        (
            Refusal::NotASpec { got: "dict" },
            RefusalKind::Type,
            "spec must be a ResidencyValueSpec, got dict",
        ),
        (
            Refusal::SourceNotLoadable,
            RefusalKind::Type,
            "source must have a callable load() method",
        ),
    ];
    for (refusal, kind, text) in cases {
        assert_eq!(refusal.kind(), kind, "{refusal}");
        assert_eq!(refusal.to_string(), text);
    }
}

#[test]
fn a_tensor_where_a_value_belongs_gets_the_wrapping_hint() {
    let tensor = Refusal::NotTensorResident {
        got: "Tensor",
        tensor: true,
    }
    .to_string();
    assert!(tensor.starts_with("value must be a TensorResident, got Tensor; wrap a tensor first"));
    let other = Refusal::NotTensorResident {
        got: "list",
        tensor: false,
    }
    .to_string();
    assert!(other.contains("wrap it first: fhelium.values.as_resident(value)"));
    let wrong = Refusal::WrongValueType {
        expected: "Pair",
        handle: "'h'",
        got: "Tensor",
        tensor: true,
    };
    assert_eq!(wrong.kind(), RefusalKind::Materialization);
    assert!(
        wrong
            .to_string()
            .starts_with("expected a Pair for value 'h', got Tensor; wrap a tensor first")
    );
    let plain = Refusal::WrongValueType {
        expected: "Pair",
        handle: "'h'",
        got: "int",
        tensor: false,
    };
    assert_eq!(plain.to_string(), "expected a Pair for value 'h', got int");
}

#[test]
fn cuda_locations_are_checked_against_the_devices_present() {
    assert_eq!(CudaDevices::from_count(0), CudaDevices::Unavailable);
    let unavailable = CudaDevices::Unavailable.check(Location::Cuda(0), 0);
    assert!(
        unavailable
            .is_err_and(|text| text.starts_with("cuda:0 is not usable: CUDA is not available"))
    );
    assert_eq!(
        CudaDevices::from_count(2).check("cuda:2", 2),
        Err("cuda:2 is not usable: only 2 CUDA device(s) present".to_owned())
    );
    assert_eq!(CudaDevices::from_count(2).check("cuda:1", 1), Ok(()));
}

#[test]
fn a_failed_cleanup_is_noted_with_its_error() {
    assert_eq!(
        cleanup_note("cuda:0", "RuntimeError('x')"),
        "cleanup after the failed transfer to cuda:0 also failed: copy stream synchronize \
         raised RuntimeError('x')"
    );
}

#[test]
fn register_source_refuses_preserved_values_then_unaccountable_counts() {
    assert_eq!(
        ValueSpec::source_bytes(false, Some(8), Some(16)),
        Ok((8, 16))
    );
    // Must-preserve is refused first, whatever the counts.
    assert_eq!(
        ValueSpec::source_bytes(true, None, None),
        Err(SourceRefusal::MustPreserve)
    );
    assert_eq!(
        ValueSpec::source_bytes(false, None, None),
        Err(SourceRefusal::TooManyBytes(SpecField::Logical))
    );
    assert_eq!(
        ValueSpec::source_bytes(false, Some(8), None),
        Err(SourceRefusal::TooManyBytes(SpecField::Storage))
    );
    assert_eq!(SpecField::Storage.name(), "spec.storage_nbytes");
    assert_eq!(SpecField::Logical.attribute(), "logical_nbytes");
    assert_eq!(ReplicaMode::of(true), ReplicaMode::Exclusive);
    assert_eq!(ReplicaMode::of(false), ReplicaMode::Replicable);
}
