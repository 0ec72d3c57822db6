"""A stand-in for a store the tests cannot have: a local folder that refuses directory renames,
as Cloud Storage FUSE does without rename support (file renames still work there). It can also
stall one write for good (WB_TEST_HANG_ON), to catch a node in the middle of a save.

`python -m tests.helpers.stores --spec ...` is workbench's cloud entrypoint with this store
registered as norename://, for per-rank processes started by torchrun.
"""
import os
import sys
import threading
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem


class NoDirRename(LocalFileSystem):
    protocol = "norename"

    @classmethod
    def _strip_protocol(cls, path):
        path = path[len("norename://"):] if str(path).startswith("norename://") else path
        return super()._strip_protocol(path)

    def mv(self, path1, path2, *args, **kwargs):
        if self.isdir(path1):
            raise OSError(f"directory rename refused by this store: {path1}")
        return super().mv(path1, path2, *args, **kwargs)

    rename = move = mv

    def _open(self, path, mode="rb", *args, **kwargs):
        hang = os.environ.get("WB_TEST_HANG_ON")
        if "w" in mode and hang and str(path).endswith(hang):
            Path(os.environ["WB_TEST_HANG_MARKER"]).touch()
            threading.Event().wait()  # stalled until the process is killed
        return super()._open(path, mode, *args, **kwargs)


def register() -> None:
    fsspec.register_implementation("norename", NoDirRename, clobber=True)


if __name__ == "__main__":
    from workbench import cloud_entry
    from workbench.errors import ConfigError

    register()
    try:
        sys.exit(cloud_entry.main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
