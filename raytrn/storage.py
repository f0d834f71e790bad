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


def s3_upload(path: str, data: Any) -> None:
    """Upload ``data`` (bytes-like) to ``bucket/key`` with boto3's managed transfer (multipart, parts in
    parallel). Measured against pyarrow's S3 output stream for sharded checkpoints: 2-2.7x faster for 136 MB
    (docs/performance.md). boto3 reads the same ``AWS_ENDPOINT_URL[_S3]`` and region settings as
    :func:`s3_filesystem`."""
    import io

    import boto3
    from boto3.s3.transfer import TransferConfig

    bucket, _, key = path.partition("/")
    config = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=16 << 20, max_concurrency=8)
    boto3.client("s3").upload_fileobj(io.BytesIO(data), bucket, key, Config=config)
