"""Typed errors of the model store: callers branch on the type, never on the message."""

from __future__ import annotations


class ModelStoreError(Exception):
    """A version or store operation that cannot be used or done; the message says why."""


class VersionNotFound(ModelStoreError):
    """The model or version does not exist (or nothing is published)."""


class IncompleteVersion(ModelStoreError):
    """No ``_SUCCESS``: the version (or delta) is still being written or was abandoned."""


class CorruptVersion(ModelStoreError):
    """A manifest that cannot be read, or files missing, unlisted or failing their checksum."""


class IncompatibleVersion(ModelStoreError):
    """A valid version that cannot replace the served one in a running stack: another feature
    schema, embedding dim or model input shape (``model_store.releases.validate``). Serving it
    takes a new stack: ``recserve publish --allow-schema-change``, then restart the stack."""


class QuantizationLoss(ModelStoreError):
    """A version served in a reduced-precision dtype loses more test AUC than the gate allows."""


class QualityDrop(ModelStoreError):
    """A full version from the stream whose progressive AUC on its latest window fell below the
    served version's on the same samples by more than the gate allows (``--max-auc-drop``)."""


class SchemaMismatch(IncompatibleVersion):
    """The version's feature schema is not the one being served (or its schema.yaml does not
    match its manifest)."""


class StoreError(ModelStoreError):
    """A shard dump that cannot be used (incomplete, corrupt or incompatible with the store), or
    a store operation that cannot be done; the message says which and why."""


class CapacityError(StoreError):
    """A store cannot take the rows it is given without dropping some: growing would pass its
    memory limit, the int32 slot limit of one shard, or the machine's memory. The message names
    the rows, the limit and what to do; at the gRPC boundary it is RESOURCE_EXHAUSTED."""

    grpc_status = "RESOURCE_EXHAUSTED"


class RecordError(CorruptVersion, StoreError):
    """A version manifest or shard meta.json that is not a valid record: a required field missing,
    an unknown field, or a value of the wrong type (``model_store.records.decode``). Both a
    corrupt version and an unusable dump: callers of either catch it."""


class UnknownFormat(RecordError):
    """A record (version manifest, shard meta) of a format this release does not read; the
    message names the record, the format found and the ones read."""
