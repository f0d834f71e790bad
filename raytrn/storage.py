"""Local paths and s3:// URIs behind one pyarrow filesystem lookup.

pyarrow ignores ``AWS_ENDPOINT_URL``; raytrn honours ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` so
the same job runs against AWS S3 or an S3-compatible endpoint (e.g. a local moto server in tests).
"""

from __future__ import annotations

import os
import shutil
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from raytrn.errors import RaytrnError


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``uri`` and the path inside it."""
    if uri.startswith("s3://"):
        parsed = urlparse(uri)
        return s3_filesystem(), f"{parsed.netloc}{parsed.path}".rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def s3_filesystem() -> pafs.S3FileSystem:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict = {}
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
        kwargs["scheme"] = parsed.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


def read_text(uri: str) -> str | None:
    """The file's text, or None when it does not exist."""
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def write_text(uri: str, text: str) -> None:
    fs, path = filesystem(uri)
    fs.create_dir(os.path.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_remote(base) else os.path.join(base, *parts)


def is_inside(path: str, root: str) -> bool:
    """Whether local ``path`` resolves (symlinks followed) to ``root`` or below it."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def remove_inside(path: str, root: str) -> None:
    """Delete the file, symlink or directory tree at local ``path`` (nothing when absent), but only strictly
    inside ``root``: the directory it sits in must resolve to ``root`` or below. A symlink is removed itself,
    never what it points to. raytrn deletes through this alone, so a path derived from user input (an output
    directory, a state file) can never reach outside the directory raytrn was told to write."""
    name = os.path.basename(path)
    parent = os.path.dirname(path) or "."
    if name in ("", ".", "..") or not is_inside(parent, root):
        raise RaytrnError(f"refusing to delete {path}: not strictly inside {root}")
    target = os.path.join(os.path.realpath(parent), name)
    if os.path.islink(target) or os.path.isfile(target):
        os.unlink(target)
    elif os.path.isdir(target):
        shutil.rmtree(target)


def remove_tree(uri: str, root: str) -> None:
    """Delete the directory tree at ``uri`` (local or remote), only strictly inside ``root`` (see
    :func:`remove_inside`; for a remote store, by path prefix: no symlinks there)."""
    if not is_remote(uri):
        remove_inside(uri, root)
        return
    fs, path = filesystem(uri)
    _, root_path = filesystem(root)
    parts = path.split("/")
    if not path.startswith(root_path.rstrip("/") + "/") or ".." in parts or "." in parts or not parts[-1]:
        raise RaytrnError(f"refusing to delete {uri}: not strictly inside {root}")
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


class S3Upload:
    """A write-only stream into one S3 object (``bucket/key``): parts of ``part_size`` bytes are uploaded with
    boto3 in background threads while the caller is still writing, so producing the bytes (DCP serializing a
    checkpoint) overlaps sending them. :meth:`finish` completes the object; :meth:`abort` leaves nothing
    behind (an S3 object exists only once its upload completed). A small object is one ``put_object``.

    Measured against pyarrow's S3 output stream for sharded checkpoints (docs/performance.md). boto3 reads the
    same ``AWS_ENDPOINT_URL[_S3]`` and region settings as :func:`s3_filesystem`.
    """

    def __init__(self, path: str, *, part_size: int = 8 << 20, max_concurrency: int = 10) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import boto3

        self.bucket, _, self.key = path.partition("/")
        self.client = boto3.client("s3")
        self.part_size = part_size
        self._buffer = bytearray()
        self._position = 0
        self._upload_id: str | None = None
        self._parts: list[Any] = []
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="raytrn-s3-upload")
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buffer += view
        self._position += len(view)
        while len(self._buffer) >= self.part_size:
            self._send(bytes(self._buffer[: self.part_size]))
            del self._buffer[: self.part_size]
        return len(view)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def _send(self, data: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        number = len(self._parts) + 1
        self._parts.append(
            self._pool.submit(
                self.client.upload_part,
                Bucket=self.bucket,
                Key=self.key,
                PartNumber=number,
                UploadId=self._upload_id,
                Body=data,
            )  # fmt: skip
        )

    def close(self) -> None:
        """Complete the object (what a writer's close means); idempotent."""
        self.finish()

    def finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._upload_id is None:
                self.client.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self._buffer))
                return
            if self._buffer:
                self._send(bytes(self._buffer))
            parts = [{"ETag": f.result()["ETag"], "PartNumber": i} for i, f in enumerate(self._parts, 1)]
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=self.key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            self.abort()
            raise
        finally:
            self._pool.shutdown(wait=True)

    def abort(self) -> None:
        self.closed = True
        for f in self._parts:
            f.cancel()
        self._pool.shutdown(wait=True)
        if self._upload_id is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
            except Exception:  # the original error matters more; S3 lifecycle rules clean up what is left
                pass
            self._upload_id = None
