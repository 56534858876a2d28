"""Checkpoints: asynchronous, sharded saves of the train state, restorable onto any device layout.

A `Checkpointer` wraps an Orbax `CheckpointManager` rooted at `WORKDIR/checkpoints`. Each step directory
`WORKDIR/checkpoints/<step>/` holds two items:

  state/  the train-state pytree (params, optimizer state, step, rng key data), written with Orbax's standard
          array format (tensorstore/OCDBT chunks plus JSON tree metadata). Every process writes its own shards.
  meta/   a small JSON dict (data position, config fingerprint, ...) saved beside the arrays.

Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it once every shard and the
`commit_success.txt` marker are in place (object stores: in place, marker last). A step counts as complete only when
its directory exists under its final name and holds that marker; anything else (a crash mid-save) is ignored.
Dropping an old step (`keep`) is atomic too: Orbax renames it into `checkpoints/deleting/`, and the Checkpointer
removes that folder in the background (and its leftovers when a run starts), so a crash mid-deletion never leaves a
half-deleted step that still looks complete.

Nothing on disk is ever executed: arrays are read by tensorstore, trees and meta from JSON; no pickle.

Every method is collective: on a multi-process run every process calls it with the same arguments, in the same
order (Orbax synchronises the processes and picks the one that writes shared files).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.cluster import distributed
from jaxpar.train import spikes
from jaxpar.state.save_errors import CheckpointSaveError, disk_full, tree_bytes

log = logging.getLogger(__name__)

_STATE = "state"
_META = "meta"
_SUBDIR = "checkpoints"
_SET_ASIDE_BARRIERS = 0
_TRASH = "deleting"  # where Orbax moves the steps it drops (one atomic rename each) before they are removed


class Checkpointer:
    """Periodic, asynchronous, sharded checkpoints of a train state in `WORKDIR/checkpoints`.

    Args:
      workdir: the run directory; checkpoints go to `workdir/checkpoints/<step>/{state,meta}`.
      every_steps: `save` writes when `step % every_steps == 0` (or when forced).
      keep: how many of the newest complete checkpoints to keep; older ones are deleted once a newer save is
        complete (a failed save deletes nothing).
      async_save: write in a background thread; `save` returns once the arrays are copied to host memory, so the
        caller may donate or delete them right after.
      read_only: for readers (sampling, export, the trainer's resume check): creates, cleans and deletes nothing.

    Raises:
      ValueError: `every_steps < 1` or `keep < 1`.
    """

    def __init__(self, workdir: str, every_steps: int, keep: int, async_save: bool = True, read_only: bool = False):
        if int(every_steps) < 1:
            raise ValueError(f"checkpoint every_steps={every_steps}: must be >= 1.")
        if int(keep) < 1:
            raise ValueError(f"checkpoint keep={keep}: must be >= 1 (the newest checkpoint is always kept).")
        self.every_steps = int(every_steps)
        self.keep = int(keep)
        self.async_save = bool(async_save)
        self.directory = os.path.join(os.path.abspath(os.fspath(workdir)), _SUBDIR)
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=self.async_save,
            save_interval_steps=0 if read_only else 1,  # what read_only forces anyway (said here, Orbax stays quiet)
            preservation_policy=ocp.checkpoint_managers.LatestN(n=self.keep),
            # leftovers of a crashed save are removed when a run starts; a reader (sample, export, the resume check)
            # never removes anything: the temporary folder may be a live run's save in progress
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
            todelete_subdir=None if read_only else _TRASH,  # delete = rename away, then remove (see _empty_trash)
        )
        if not read_only:  # before Orbax lists the steps: a marker-less step folder is set aside, not resumed over
            self._set_aside_incomplete()
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, arg_types in ((_STATE, (ocp.args.StandardSave, ocp.args.StandardRestore)),
                                (_META, (ocp.args.JsonSave, ocp.args.JsonRestore))):
            for arg_type in arg_types:
                registry.add(item, arg_type)
        with _quiet(read_only):  # Orbax warns about every option a read-only manager ignores, and the mode itself
            self._mngr = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self._pending: int | None = None  # step of the last save whose outcome has not been checked yet
        self._pending_bytes = 0  # bytes of the state that save is writing (for a full disk's message)
        self._closed = False
        self._read_only = bool(read_only)
        self._cleaners: list[threading.Thread] = []
        if not read_only and jax.process_index() == 0:  # steps a crashed run was deleting
            for name in os.listdir(self.directory):
                if name == _TRASH or name.startswith(_TRASH + "."):
                    _remove_tree(os.path.join(self.directory, name))

    @classmethod
    def from_config(cls, workdir: str, config) -> "Checkpointer":
        """Build from `config.checkpoint` (`every_steps`, `keep`, `async_save`)."""
        c = config.checkpoint
        return cls(workdir, every_steps=c.every_steps, keep=c.keep, async_save=c.async_save)

    # ---------------------------------------------------------------------------------------------- saving

    def save(self, step: int, state: Any, meta: dict, force: bool = False) -> bool:
        """Save `state` and `meta` as checkpoint `step` when `step % every_steps == 0` or `force`.

        `state` is a pytree of `jax.Array`s (any sharding) and array-likes; `meta` a JSON-serialisable dict, copied
        before returning. With `async_save` the write continues in the background; the previous save is waited for
        (and its error raised) first. A step that already has a complete checkpoint is not written again.

        Returns:
          True when a save was started, False when skipped (not a save step, or already saved).

        Raises:
          CheckpointSaveError: this save, or the previous asynchronous one, failed; or `step`'s directory exists
            without being a complete checkpoint (remove it by hand).
          TypeError: `meta` is not a JSON-serialisable dict.
          RuntimeError: the checkpointer is closed.
        """
        self._check_open()
        step = int(step)
        if not force and step % self.every_steps:
            return False
        if not isinstance(meta, dict):
            raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}.")
        try:
            meta = json.loads(json.dumps(meta))  # a private copy; fails now, not in the background
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint meta is not JSON-serialisable: {e}") from e
        self.wait()
        if step in self._mngr.all_steps():  # the manager's list is the same on every process
            if step in self.all_steps():
                log.info("checkpoint for step %d already exists; not saving it again", step)
                return False
            raise CheckpointSaveError(step, FileExistsError(
                f"{os.path.join(self.directory, str(step))} exists but is not a complete checkpoint; remove it"))
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)})
        self._pending, self._pending_bytes = step, tree_bytes(state)
        saved = False
        try:
            saved = self._mngr.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - any I/O or serialisation error is a failed save
            self._failed(e)
        if not self.async_save:
            self._pending = None
        return bool(saved)

    def wait(self) -> None:
        """Block until the pending asynchronous save is complete on disk.

        Raises:
          CheckpointSaveError: that save failed (raised once; the checkpointer stays usable).
        """
        if self._closed:
            return
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._failed(e)
        self._pending = None
        self._empty_trash()

    def close(self) -> None:
        """Wait for the pending save, then release Orbax's threads. Idempotent.

        Raises:
          CheckpointSaveError: the pending save failed (resources are released all the same).
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            try:
                self._mngr.close()
            except Exception:  # noqa: BLE001 - its error, if any, was raised by wait() above
                log.exception("closing the checkpoint manager")
            for t in self._cleaners:
                t.join()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------------------------------- reading

    def all_steps(self) -> list[int]:
        """Steps with a complete checkpoint on disk, ascending (a save still being written is not listed)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            if name.isdigit() and os.path.isfile(
                    os.path.join(self.directory, name, ocp.path.atomicity.COMMIT_SUCCESS_FILE)):
                steps.append(int(name))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or None. Does not wait for a save in progress."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Read checkpoint `step` into the layout described by `abstract_state`.

        Args:
          step: a complete step (see `all_steps`).
          abstract_state: the state's pytree (same structure as saved) of `jax.ShapeDtypeStruct`s whose `sharding`
            is the layout to restore onto; any mesh and device count, independent of the one that saved.

        Returns:
          (state, meta): `state` has `abstract_state`'s structure, each leaf a `jax.Array` with exactly the
          requested sharding and the saved values; `meta` is the dict saved with it.

        Raises:
          FileNotFoundError: no complete checkpoint for `step`.
          ValueError: a leaf of `abstract_state` has no sharding, or its arrays (names, shapes, dtypes) differ from
            the checkpoint's; checked before any array is read. Dtypes must match: no silent casts.
        """
        step = self._existing(step)
        abstract_state, target = spikes.restore_target(abstract_state, self._saved_leaves(step))
        self._check_abstract(step, abstract_state)
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract_state), _META: ocp.args.JsonRestore()})
        restored = self._mngr.restore(step, args=args)
        state = restored[_STATE]
        if target is not None:  # the loss-spike window, made the size asked for (`spikes.resize`)
            host = jax.device_get(state.get(spikes.GROUP))
            state = {**state, spikes.GROUP: jax.device_put(spikes.resize(host, target[0]), target[1])}
        return state, restored[_META]

    def restore_part(self, step: int, abstract_part: Any) -> Any:
        """Read only the leaves `abstract_part` names of checkpoint `step` (e.g. `{"params": ...}`: a run read back
        for sampling or export, no optimizer state built or read) onto their shardings; raises as `restore` does (a
        leaf not in the checkpoint, or of another shape or dtype, before any array is read)."""
        step = self._existing(step)
        self._check_abstract(step, abstract_part, part=True)
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                                                    dtype=a.dtype), abstract_part)
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(os.path.join(self.directory, str(step), _STATE), args=ocp.args.PyTreeRestore(
                abstract_part, restore_args=restore_args, partial_restore=True))

    def _saved_leaves(self, step: int) -> dict:
        """{leaf name: metadata with .shape and .dtype} of checkpoint `step`'s state; no array is read."""
        saved_tree = self._mngr.metadata(step).item_metadata[_STATE]
        return {_leaf_name(path): m for path, m in
                jax.tree_util.tree_flatten_with_path(getattr(saved_tree, "tree", saved_tree))[0]}

    def read_meta(self, step: int) -> dict:
        """The meta dict saved with checkpoint `step`; no array is read.

        Raises:
          FileNotFoundError: no complete checkpoint for `step`.
        """
        step = self._existing(step)
        return self._mngr.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]

    # ------------------------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer for {self.directory} is closed.")

    def _existing(self, step: int) -> int:
        self._check_open()
        step = int(step)
        steps = self.all_steps()
        if step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory}; complete steps: {steps or 'none'}.")
        return step

    def _check_abstract(self, step: int, abstract_state: Any, part: bool = False) -> None:
        want = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
            if getattr(leaf, "sharding", None) is None or not hasattr(leaf, "shape"):
                raise ValueError(
                    f"restore: leaf {jax.tree_util.keystr(path)} of abstract_state is {leaf!r}; every leaf must be a "
                    f"jax.ShapeDtypeStruct with sharding= set to the layout to restore onto.")
            want[_leaf_name(path)] = leaf
        saved = self._saved_leaves(step)
        problems = [f"missing from the checkpoint: {k}" for k in sorted(want.keys() - saved.keys())]
        problems += [f"in the checkpoint but not in abstract_state: {k}" for k in sorted(saved.keys() - want.keys())
                     if not part]
        for k in sorted(want.keys() & saved.keys()):
            w, m = want[k], saved[k]
            if tuple(w.shape) != tuple(m.shape) or not _same_dtype(w.dtype, m.dtype):
                problems.append(f"{k}: saved {m.dtype}{list(m.shape)}, requested {w.dtype}{list(w.shape)}")
        if problems:
            shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
            raise ValueError(f"restore of step {step} from {self.directory}: abstract_state does not match the "
                             f"checkpoint:\n  " + "\n  ".join(shown))

    def _set_aside_incomplete(self) -> None:
        """Move every step folder without its commit marker (a crash between the arrays and the marker, or what an
        object store leaves) into the trash, which is emptied right after; complete steps are never touched.
        Process 0 does it, then every process passes a barrier, so all of them list the same steps."""
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            for name in sorted(os.listdir(self.directory)):
                path = os.path.join(self.directory, name)
                marker = os.path.join(path, ocp.path.atomicity.COMMIT_SUCCESS_FILE)
                if name.isdigit() and os.path.isdir(path) and not os.path.isfile(marker):
                    aside = os.path.join(self.directory, f"{_TRASH}.{time.time_ns()}.incomplete-{name}")
                    os.rename(path, aside)
                    print(f"jaxpar: {path} is not a complete checkpoint (no {ocp.path.atomicity.COMMIT_SUCCESS_FILE}"
                          f", an interrupted save): set aside and removed", flush=True)
        global _SET_ASIDE_BARRIERS
        _SET_ASIDE_BARRIERS += 1  # every process builds its Checkpointers in the same order (collective)
        distributed.barrier(f"jaxpar/checkpoint_set_aside/{_SET_ASIDE_BARRIERS}")

    def _empty_trash(self) -> None:
        """Remove the steps Orbax has dropped into the trash folder, in a background thread.

        Called only when no save is in flight (so Orbax is not moving a step into the folder): the folder is first
        renamed to a unique name, so the next save's deletions start a fresh one. Process 0 only (Orbax's primary
        host does the deleting)."""
        trash = os.path.join(self.directory, _TRASH)
        if self._read_only or jax.process_index() != 0 or not os.path.isdir(trash):
            return
        doomed = f"{trash}.{time.time_ns()}"
        os.rename(trash, doomed)
        self._cleaners = [t for t in self._cleaners if t.is_alive()]
        cleaner = threading.Thread(target=_remove_tree, args=(doomed,), name="jaxpar-checkpoint-trash", daemon=True)
        cleaner.start()
        self._cleaners.append(cleaner)

    def _failed(self, e: BaseException):
        step, self._pending = self._pending, None
        # The manager already forgot the failed step; re-read the disk so that retention counts what is there.
        try:
            self._mngr.reload()
        except Exception:  # noqa: BLE001
            log.exception("re-reading %s after a failed save", self.directory)
        raise CheckpointSaveError(step, e, self._full_disk_message() if disk_full(e) else "") from e

    def _full_disk_message(self) -> str:
        free = shutil.disk_usage(self.directory).free
        kept = self.latest_step()
        last = f"step {kept}, is kept and restorable" if kept is not None else "none exists yet"
        return (f"no space left on the device of {self.directory}: {free:,} bytes free, and a checkpoint of this "
                f"train state needs about {self._pending_bytes:,} bytes; the last complete checkpoint, {last}. Free "
                f"space (or move the workdir), then rerun the same command to resume from it.")


def _remove_tree(path: str) -> None:
    """Remove a dropped step folder; a failure is logged (it is garbage outside every step), never raised."""
    try:
        shutil.rmtree(path)
    except Exception:  # noqa: BLE001
        log.exception("removing %s", path)


def _leaf_name(path) -> str:
    """'opt_state.0.mu.embed': a leaf's path, spelled alike for a live pytree and for Orbax's saved tree metadata
    (which keeps NamedTuples as dicts and tuples as lists)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _same_dtype(a, b) -> bool:
    try:
        return np.dtype(a) == np.dtype(b)
    except TypeError:  # e.g. typed PRNG keys
        return str(a) == str(b)


@contextlib.contextmanager
def _quiet(on: bool):
    """absl logging at ERROR inside the block when `on` (restored after)."""
    from absl import logging

    before = logging.get_verbosity()
    if on:
        logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(before)
