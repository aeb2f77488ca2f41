"""Sharded checkpoints of an FSDP LM run (``LMConfig.fsdp`` under torchrun): ``torch.distributed.checkpoint`` (DCP).

Each rank writes the shards it holds of the policy, PPO's critic and AdamW's moments into its own files
(``__<rank>_0.distcp``) of one directory, and rank 0 the directory's ``.metadata`` (which chunk of which tensor is
where); no rank gathers a whole tensor. The state dicts are ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict`` (parameters and optimizer states keyed by parameter names, the same keys sharded or not), so a
checkpoint written on K ranks loads on any other number of ranks, or in one process into whole tensors: DCP cuts
what each loader asks for out of the saved chunks (it reshards on load).

Atomic, as ``checkpoint.save_checkpoint`` is: the ranks write into ``.shards-<token>.tmp`` (a name rank 0 draws
and sends to every rank), and once DCP has returned on every rank (its ``.metadata`` is written last, after every
rank's files, all fsynced) rank 0 renames it to ``shards-<iteration>-<token>`` and then writes the run dir's
``trainer_state.pt`` (counters, random streams, the prompt cursor, the KL controller: the small host state,
written atomically) naming that directory. Only then are the older ``shards-*`` directories removed. A kill -9 at
any moment leaves the previous ``trainer_state.pt`` naming a directory that is still whole; a killed write's
``.shards-*.tmp`` is removed by the next claim of the run dir (``rundir.claim``), an orphaned ``shards-*`` (renamed,
not yet named) by the next save.

Every rank writes into the run dir, so on several hosts it must be a filesystem they all see (NFS, Lustre), as
DCP's ``FileSystemWriter`` assumes; one host's ranks (torchrun on one machine) share it anyway.

Loading runs no code from the files. DCP's own reader unpickles ``.metadata`` with ``pickle.load`` and its default
planner reads every non-tensor entry with ``torch.load(weights_only=False)`` (torch 2.13,
``filesystem.FileSystemReader.read_metadata``, ``default_planner.DefaultLoadPlanner.load_bytes``): both would run
whatever a forged file pickled. Here the metadata goes through an unpickler that builds DCP's metadata
dataclasses, ``torch.Size``, dtypes and paths and refuses every other global, and non-tensor entries go through
``torch.load(weights_only=True)``, as the tensors already do; the same guarantee as ``checkpoint.load_checkpoint``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pickle
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ppokit.runtime.checkpoint import CheckpointError, one_line
from ppokit.runtime.rundir import SHARDS_PREFIX

__all__ = ["save_shards", "load_shards", "remove_old_shards", "full_model_state", "is_shards_name", "gather_tensor",
           "export_policy"]

_NAME = re.compile(rf"{re.escape(SHARDS_PREFIX)}\d+-[0-9a-f]{{32}}")


def is_shards_name(name: Any) -> bool:
    """A name ``save_shards`` gives (no path separator, no ``..``): what a checkpoint's ``shards`` entry may hold."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def _container(modules: dict[str, nn.Module]) -> nn.Module:
    # One module over the checkpointed ones, for get_state_dict's parameter names ("policy.model.layers.0...",
    # "value_model.trunk..."): PPO's one AdamW steps both models' parameters.
    return nn.ModuleDict(modules)


def _state(modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(_container(modules), optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _local_finite(obj: Any) -> bool:
    """Every floating tensor this rank holds of ``obj`` (a ``DTensor``: its local shard) is finite."""
    if isinstance(obj, dict):
        return all(_local_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_local_finite(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return not t.is_floating_point() or bool(torch.isfinite(t).all())
    return True


def _token(dist) -> str:
    """A fresh random hex token, rank 0's on every rank (sent as bytes: no pickle; the global RNG untouched)."""
    raw = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8)
    if dist.active:
        raw = raw.to(dist._comm_device())  # nccl sends CUDA tensors only
        with dist._guard("agreeing on a sharded checkpoint's name"):
            torch.distributed.broadcast(raw, src=0)
    return bytes(raw.cpu().tolist()).hex()


def gather_tensor(t: torch.Tensor, dist) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape and dtype on each), in rank order, on every rank's CPU."""
    if not dist.active:
        return [t.clone()]
    device = dist._comm_device()
    out = [torch.empty_like(t, device=device) for _ in range(dist.world_size)]
    with dist._guard("gathering the ranks' sampling streams"):
        torch.distributed.all_gather(out, t.to(device))
    return [x.cpu() for x in out]


def save_shards(directory: Path, modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer, iteration: int,
                dist) -> str:
    """Every rank's shards of ``modules`` and ``optimizer`` into a fresh directory of ``directory``, published under
    the name returned (every rank must call it). Non-finite weights or moments on any rank refuse the save on all
    of them (``CheckpointError``), so a diverged run cannot replace its last good checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = _state(modules, optimizer)
    if dist.any(not _local_finite(state)):
        raise CheckpointError("the policy's or the optimizer's state contains NaN or Inf; refusing to checkpoint "
                              "a diverged state (the previous checkpoint stays)")
    token = _token(dist)
    tmp, final = directory / f".{SHARDS_PREFIX}{token}.tmp", directory / f"{SHARDS_PREFIX}{iteration}-{token}"
    if dist.is_main:
        directory.mkdir(parents=True, exist_ok=True)
    try:
        failure = None
        with dist._guard("writing a sharded checkpoint"), _one_process_quiet():  # the guard: a rank lost
            try:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=not dist.active)
            except CheckpointException as exc:  # a full disk, a read-only directory: DCP raises it on every rank
                failure = _first_failure(exc)
        if failure is not None:
            raise CheckpointError(f"could not write the sharded checkpoint {tmp}: {failure}; the previous "
                                  "checkpoint stays")
        if dist.is_main:
            os.rename(tmp, final)
            _fsync_dir(directory)
    except BaseException:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final.name


def _first_failure(exc: BaseException) -> str:
    """One line for a DCP failure: its ``CheckpointException`` (a BaseException) holds each failed rank's
    ``(exception, stack)``; the first rank's exception is the cause."""
    failures = getattr(exc, "failures", None)
    first = next(iter(failures.values())) if isinstance(failures, dict) and failures else exc
    return one_line(first[0] if isinstance(first, tuple) else first)


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns at every save and load in one process that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_old_shards(directory: Path, keep: str | None) -> None:
    """Every ``shards-*`` directory of ``directory`` but ``keep`` (after the checkpoint naming ``keep`` is written)."""
    for path in directory.glob(f"{SHARDS_PREFIX}*"):
        if path.name != keep and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- loading without running code
# What DCP's .metadata pickles (torch 2.13: checked by listing the globals of a saved file's pickle): its metadata
# dataclasses, the storage info of each chunk, torch.Size, dtypes, layouts and the checkpoint's path.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, from torch's own table
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _METADATA_CLASSES.get(module, ()):
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader with its metadata unpickled by ``_MetadataUnpickler``."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses

    class SafePlanner(DefaultLoadPlanner):
        """DCP's planner with non-tensor entries (AdamW's param groups) read by ``torch.load(weights_only=True)``."""

        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def load_shards(path: Path, modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer | None, dist) -> None:
    """The checkpoint ``save_shards`` wrote at ``path`` into ``modules`` and ``optimizer``, sharded or whole, on any
    number of ranks (every rank must call it). ``optimizer`` None: the weights of ``modules`` alone (the offline
    export; other models in the checkpoint are left out). ``CheckpointError`` in one line for a missing, damaged or
    foreign checkpoint, or one holding NaN/Inf."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, set_state_dict

    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: no sharded checkpoint there (its .metadata is missing)")
    state = _state(modules, optimizer) if optimizer is not None else {"model": get_model_state_dict(_container(modules))}
    try:
        with _one_process_quiet():
            dcp.load(state, storage_reader=_reader(path), planner=_planner(),
                     no_dist=not (dist.active and torch.distributed.is_initialized()))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one line names the file
        raise CheckpointError(f"{path} cannot be loaded into this run's models: {_first_failure(exc)}") from None
    if dist.any(not _local_finite(state)):
        raise CheckpointError(f"{path} holds NaN or Inf in the policy's or the optimizer's state; refusing to "
                              "resume a diverged state")
    if optimizer is None:
        set_model_state_dict(_container(modules), state["model"])
    else:
        set_state_dict(_container(modules), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


def export_policy(run_dir: Path, model: nn.Module, tokenizer: Any, out: Path) -> int:
    """The policy of a sharded run's latest checkpoint, consolidated offline in this process: its weights loaded
    into ``model`` (the run's starting model: the same architecture) and written to ``out`` with
    ``save_pretrained`` (and the tokenizer's), which ``from_pretrained`` loads. For a run killed between its final
    saves, whose ``policy/`` is older than its shards. Returns the checkpoint's iteration."""
    from ppokit.lm.durable import CHECKPOINT
    from ppokit.runtime.checkpoint import load_checkpoint
    from ppokit.runtime.distributed import LOCAL

    state = load_checkpoint(run_dir / CHECKPOINT)
    name = state.get("shards")
    if name is None:
        raise CheckpointError(f"{run_dir / CHECKPOINT} is a consolidated checkpoint (not a sharded fsdp run's): "
                              f"its policy/ is the export already")
    if not is_shards_name(name):
        raise CheckpointError(f"{run_dir / CHECKPOINT} names no sharded checkpoint directory ({name!r}); it was "
                              "damaged or not written by ppokit")
    if out.exists():
        raise FileExistsError(f"{out} exists; give a new directory to export into")
    load_shards(run_dir / name, {"policy": model}, None, LOCAL)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp")
    try:
        model.save_pretrained(tmp)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        os.rename(tmp, out)  # whole or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return int(state["iteration"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict on rank 0's CPU (every rank must call it; the others get ``{}``): the
    consolidated export's weights, gathered one tensor at a time (``full_state_dict``, ``cpu_offload``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
