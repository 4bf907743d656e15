"""Ray as the engine for the parallel work (`--ray [ADDRESS]`): actors that each build their worker once (load the
models once), tasks that are items (system prompts, eval shards), completions in any order. Without Ray the same
worker runs the items in this process.

Faults: a task whose worker raised is retried (on whichever actor is free) and then reported per item. An actor
that dies (killed, out of memory, its node lost) leaves the pool at once, its task goes back to the queue for a live
actor, and a fresh actor takes its place while the restart budget lasts (`RESTARTS` per worker slot). Ray's own
`max_restarts`/`max_task_retries` would restart the dead actor and retry the task *on it* after the restart (a model
load later); replacing it while the others carry on keeps the batch moving, and a task is never retried on a dead
actor. When every actor is dead and the budget is spent, the items left are reported, not lost.

What travels between processes is what Ray moves (the items and plain-dict results); exports themselves go
through the catalog (safetensors + JSON), never through Ray's object store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from edgekv import EdgeKVError

RETRIES = 2  # a task whose worker raised runs at most RETRIES + 1 times
RESTARTS = 2  # fresh actors per worker slot after deaths


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise EdgeKVError("--ray needs the ray package (pip install 'edgekv[ray]')") from exc
    return ray


def connect(address: str | None):
    """Join the Ray cluster at `address` ('auto': the one this machine belongs to), or start a local one."""
    ray = _ray()
    if not ray.is_initialized():
        try:
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise EdgeKVError(f"--ray {address or '(local)'}: cannot start or join a Ray cluster ({exc})") from exc
    return ray


def run_items(make_worker: Callable[[], Callable[[object], dict]], items: Iterable, address: str | None = None,
              workers: int = 1, cpus_per_worker: float = 1.0, on_done: Callable[[dict], None] | None = None,
              use_ray: bool = True) -> list[dict]:
    """`worker(item)` for every item, a worker built once per actor (or once here without Ray), results in the
    items' order (`on_done` sees them as they complete). A result is the worker's dict plus `item`; an item whose
    task failed `RETRIES + 1` times is `{"item", "error"}`."""
    items = list(items)
    results: list[dict | None] = [None] * len(items)

    def done(k: int, result: dict) -> None:
        results[k] = result
        if on_done:
            on_done(result)

    if not use_ray:
        worker = make_worker()
        for k, item in enumerate(items):
            try:
                done(k, {"item": item, **worker(item)})
            except EdgeKVError as exc:
                done(k, {"item": item, "error": str(exc)})
        return results
    ray = connect(address)

    @ray.remote(num_cpus=cpus_per_worker)
    class Actor:
        def __init__(self, factory):
            self.worker = factory()

        def run(self, item):
            return self.worker(item)

    slots = max(1, min(workers, len(items)))
    free = [Actor.remote(make_worker) for _ in range(slots)]
    restarts = RESTARTS * slots
    pending = {}  # ref → (index, attempts, actor)
    queue = [(k, 0) for k in range(len(items))]
    while queue or pending:
        while queue and free:
            k, attempts = queue.pop(0)
            actor = free.pop(0)
            pending[actor.run.remote(items[k])] = (k, attempts, actor)
        if not pending:  # no actor left to run what is queued
            for k, _ in queue:
                done(k, {"item": items[k], "error": "no live Ray worker left (restart budget spent)"})
            break
        ready, _ = ray.wait(list(pending), num_returns=1)
        ref = ready[0]
        k, attempts, actor = pending.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the actor died: it leaves the pool, a fresh one may replace it
            ray.kill(actor, no_restart=True)
            if restarts > 0:
                restarts -= 1
                free.append(Actor.remote(make_worker))
            if attempts < RETRIES:  # first on the next live actor; an item that kills every actor is reported
                queue.insert(0, (k, attempts + 1))
            else:
                done(k, {"item": items[k], "error": f"its worker died {attempts + 1} times ({type(exc).__name__})"})
            continue
        except Exception as exc:  # the worker raised: retry, then report this item
            free.append(actor)
            if attempts < RETRIES:
                queue.append((k, attempts + 1))
            else:
                cause = getattr(exc, "cause", None) or exc
                done(k, {"item": items[k], "error": f"{type(cause).__name__}: {str(cause).splitlines()[0]}"})
            continue
        free.append(actor)
        done(k, {"item": items[k], **result})
    return results
