"""Optional progress reporting for long library calls: one task per stage, a no-op without a progress bar. (Named
`Tasks`, and passed as `tasks`, so that `steps` always means training steps.)"""

from __future__ import annotations

from collections.abc import Callable


class Tasks:
    """Wraps a rich `Progress` (or None): `task(description, total)` returns an advance callback."""

    def __init__(self, progress=None):
        self.progress = progress

    def task(self, description: str, total: int) -> Callable[..., None]:
        """Add a task; the returned callback advances it by one (it ignores its arguments)."""
        if self.progress is None:
            return lambda *_: None
        task_id = self.progress.add_task(description, total=total)
        return lambda *_: self.progress.advance(task_id)
