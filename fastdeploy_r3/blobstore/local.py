"""LocalBlobStore: a blob store in a directory, one file per key, written atomically and 0600."""

from __future__ import annotations

import os
import secrets
import shutil

from fastdeploy_r3.blobstore.base import DIR_MODE, BlobStore, BlobStoreError, open_new_private, write_atomic


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class LocalBlobStore(BlobStore):
    """Files under `root`; key `a/b.npy` is the file `root/a/b.npy`. Values have no expiry."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def put(self, key: str, value: bytes | memoryview, ttl_s: int | None = None) -> None:
        try:
            write_atomic(self.path(key), value)
        except OSError as e:
            raise BlobStoreError(f"cannot write {self.path(key)}: {e}") from e

    def get(self, key: str) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise BlobStoreError(f"cannot read {self.path(key)}: {e}") from e

    def exists(self, keys: list[str]) -> list[bool]:
        return [os.path.isfile(self.path(k)) for k in keys]

    def put_many(self, items: dict[str, bytes], ttl_s: int | None = None) -> None:
        """Every item or none, as a reader sees it. Items whose keys share a top directory
        (`rid/layer_3.npy`, `rid/layer_5.npy`) are written into a hidden staging directory that is renamed
        into place whole, so a reader never finds some layers of a rollout without the others; a failure
        anywhere (disk full, read-only) takes back what this call put in place."""
        groups: dict[str, dict[str, bytes]] = {}
        for key, value in items.items():
            top, sep, _ = key.partition("/")
            groups.setdefault(top if sep else "", {})[key] = value
        placed: list[tuple[str, str | None]] = []  # (path put in place, what it replaced, set aside)
        try:
            for top, group in groups.items():
                if top:
                    placed.append(self._put_dir(top, group))
                    continue
                for key, value in group.items():
                    write_atomic(self.path(key), value)
                    placed.append((self.path(key), None))
        except OSError as e:
            for path, aside in reversed(placed):
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    _unlink_quietly(path)
                if aside is not None:
                    os.rename(aside, path)
            raise BlobStoreError(f"cannot write {len(items)} item(s) under {self.root}: {e}") from e
        for _, aside in placed:
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)

    def _put_dir(self, top: str, group: dict[str, bytes]) -> tuple[str, str | None]:
        tag = f"{os.getpid()}.{secrets.token_hex(4)}"
        stage, target = os.path.join(self.root, f".{top}.tmp.{tag}"), self.path(top)
        aside = None
        try:
            for key, value in group.items():
                path = os.path.join(stage, key.partition("/")[2])
                os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
                with open_new_private(path) as f:
                    f.write(value)
            if os.path.exists(target):
                aside = os.path.join(self.root, f".{top}.old.{tag}")
                os.rename(target, aside)
            os.rename(stage, target)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            if aside is not None and not os.path.exists(target):
                os.rename(aside, target)  # what was there stays
            raise
        return target, aside

    def put_if_absent(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        # a hard link creates the name only if it does not exist: two writers never replace each other
        path = self.path(key)
        tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        except OSError as e:
            raise BlobStoreError(f"cannot write {path}: {e}") from e
        return True

    def tail(self, key: str, nbytes: int) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise BlobStoreError(f"cannot read {self.path(key)}: {e}") from e

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            try:
                os.unlink(self.path(k))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise BlobStoreError(f"cannot delete {self.path(k)}: {e}") from e

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own file."""
