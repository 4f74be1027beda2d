"""Content-addressed blob storage on S3 (any S3-compatible server) through the `minio` SDK.

Blobs live at `blobs/sha256/<hex>`. An upload streams into an S3 multipart upload while it hashes; the multipart
upload is completed (made visible) only after the received bytes match the announced size and sha256, and is
aborted otherwise, so a failed or cancelled upload leaves nothing visible. Blobs smaller than one part are buffered
and written with a single PUT after the same check. So are blobs whose sha256 comes after their bytes (a publish
trailer): their key is not known until the last byte, and S3 cannot rename an object, so the bytes are held until
they are checked and then written (parts in parallel).

The minio SDK is synchronous: every call runs in a thread pool so the event loop keeps serving other RPCs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import urlunsplit

import urllib3
from minio import Minio
from minio import time as minio_time
from minio.datatypes import Part
from minio.error import MinioException, S3Error
from minio.signer import sign_v4_s3

from loraplane import errors

log = logging.getLogger(__name__)

BLOB_PREFIX = "blobs/sha256/"
# S3 requires every part but the last to be at least 5 MiB. Parts are streamed while their bytes arrive, so a large
# part costs no extra latency, and fewer parts mean fewer requests.
MIN_PART_BYTES = 5 * 1024 * 1024
PART_BYTES = max(MIN_PART_BYTES, int(os.environ.get("LORAPLANE_REGISTRY_PART_BYTES") or 16 * 1024 * 1024))
# A publisher that stalls this long mid-part loses its upload (and frees the sending thread).
PART_STALL_SECONDS = 120
# Pieces of a blob read from S3 ahead of the one being sent.
READ_AHEAD_CHUNKS = 8
# Parts of a buffered blob sent at once.
PARALLEL_PARTS = 4

T = TypeVar("T")
_NOT_FOUND_CODES = ("NoSuchKey", "NoSuchObject", "NotFound")
_EXPECTED_S3_CODES = (*_NOT_FOUND_CODES, "BucketAlreadyOwnedByYou", "BucketAlreadyExists")


def blob_key(sha256: str) -> str:
    return BLOB_PREFIX + sha256


@dataclass
class StoredBlob:
    sha256: str
    size: int


class BlobStore:
    def __init__(self, endpoint: str, access_key: str, secret_key: str, bucket: str, *, secure: bool = False,
                 region: str = "", workers: int = 16):
        self.endpoint = endpoint
        self.bucket = bucket
        # minio's default client retries for ~6 s and waits 5 min on reads; a dead S3 should surface quickly as
        # UNAVAILABLE instead, and the caller retries.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=3.0, read=60.0), maxsize=workers,
            retries=urllib3.Retry(total=2, backoff_factor=0.1, status_forcelist=[500, 502, 503, 504]),
        )
        self.client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure,
                            region=region or None, http_client=http)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="s3")
        # Streamed part uploads wait on their caller's bytes; their own pool keeps them from starving other calls.
        self._part_pool = ThreadPoolExecutor(64, thread_name_prefix="s3-part")

    async def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        except S3Error as exc:
            if exc.code in _EXPECTED_S3_CODES:
                raise
            raise self._unavailable(exc, what) from None
        except (urllib3.exceptions.HTTPError, OSError, MinioException) as exc:
            raise self._unavailable(exc, what) from None

    def _unavailable(self, exc: BaseException, what: str) -> BaseException:
        """UNAVAILABLE for what S3 or the way to it did wrong; anything else as it is."""
        if isinstance(exc, S3Error):
            return errors.Unavailable(
                f"S3 at {self.endpoint} (bucket {self.bucket!r}) refused to {what}: {exc.code}: {exc.message}",
                reason="S3_ERROR")
        if isinstance(exc, (urllib3.exceptions.HTTPError, OSError, MinioException)):
            return errors.Unavailable(
                f"S3 at {self.endpoint} (bucket {self.bucket!r}) is unavailable while trying to {what}: "
                f"{type(exc).__name__}: {exc}", reason="S3_UNAVAILABLE")
        return exc

    async def ensure_bucket(self) -> None:
        if not await self._call("check the bucket", self.client.bucket_exists, self.bucket):
            try:
                await self._call("create the bucket", self.client.make_bucket, self.bucket)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    async def exists(self, sha256: str) -> bool:
        try:
            await self._call("stat a blob", self.client.stat_object, self.bucket, blob_key(sha256))
            return True
        except S3Error as exc:
            if exc.code in _NOT_FOUND_CODES:
                return False
            raise

    async def upload(self, chunks: AsyncIterator[bytes], size: int, sha256: str,
                     verify: Callable[[], None] | None = None) -> StoredBlob:
        """Consumes `chunks` (exactly `size` bytes hashing to `sha256`) into `blobs/sha256/<sha256>`.

        Raises InvalidArgument when the stream is longer or shorter than `size`, DataLoss when the digest differs,
        and whatever `verify` (a check of the content, called once length and digest are right) raises. On any
        failure or cancellation the multipart upload is aborted: nothing becomes visible.
        """
        if size < MIN_PART_BYTES:
            parts, actual = await self._receive(chunks, size, keep=True)
            _check_digest(actual, sha256, "header.sha256", "header")
            if verify is not None:
                verify()
            await self._write(sha256, parts, size)
            return StoredBlob(sha256, size)
        return await self._upload_multipart(chunks, size, sha256, verify)

    async def upload_trailed(self, chunks: AsyncIterator[bytes], size: int, trailer: Callable[[], str],
                             verify: Callable[[], None] | None, claim: Callable[[str], Awaitable[None]]
                             ) -> StoredBlob:
        """Like `upload`, for a blob whose sha256 `trailer` returns once the stream has ended (raising if the
        stream brought none). The bytes are held until they are checked; then `claim(sha256)` runs (it must
        protect that blob from garbage collection until the caller commits or releases it) and the blob is written,
        unless a blob of that digest is stored already. Raises as `upload` does, DataLoss naming trailer.sha256."""
        parts, actual = await self._receive(chunks, size, keep=True)
        _check_digest(actual, trailer(), "trailer.sha256", "trailer")
        if verify is not None:
            verify()
        await claim(actual)
        if not await self.exists(actual):
            await self._write(actual, parts, size)
        return StoredBlob(actual, size)

    async def digest(self, chunks: AsyncIterator[bytes], size: int, trailer: Callable[[], str]) -> str:
        """Reads a stream of `size` bytes without storing it; returns its sha256 once checked against `trailer`'s."""
        _, actual = await self._receive(chunks, size, keep=False)
        _check_digest(actual, trailer(), "trailer.sha256", "trailer")
        return actual

    @staticmethod
    async def _receive(chunks: AsyncIterator[bytes], size: int, *, keep: bool) -> tuple[list[bytes], str]:
        """The stream's chunks (when `keep`) and sha256, once it has brought exactly `size` bytes."""
        hasher = hashlib.sha256()
        parts: list[bytes] = []
        received = 0
        async for chunk in chunks:
            received += len(chunk)
            _check_not_too_long(received, size)
            hasher.update(chunk)
            if keep:
                parts.append(chunk)
        _check_length(received, size)
        return parts, hasher.hexdigest()

    async def _write(self, sha256: str, parts: list[bytes], size: int) -> None:
        """Writes checked bytes at the blob's key: one PUT below the multipart minimum, else parts in parallel."""
        if size < MIN_PART_BYTES:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            await self._call("write a blob", self._put, blob_key(sha256), data)
            return
        key = blob_key(sha256)
        creating = asyncio.ensure_future(self._call("start a multipart upload", self.client._create_multipart_upload,
                                                    self.bucket, key, {}))
        streams: list[_PartStream] = []
        for chunk in parts:
            view = memoryview(chunk)
            while view:
                if not streams or streams[-1].remaining == 0:
                    number = len(streams) + 1
                    streams.append(_PartStream(number, min(PART_BYTES, size - (number - 1) * PART_BYTES)))
                take = min(len(view), streams[-1].remaining)
                streams[-1].feed(view[:take])
                view = view[take:]
        completed = stopping = False
        try:
            upload_id = await creating
            loop = asyncio.get_running_loop()
            sending = asyncio.Semaphore(PARALLEL_PARTS)

            async def send(part: _PartStream) -> str:
                async with sending:
                    if stopping:
                        raise _UploadStopped(f"part {part.number} not sent: the upload failed")
                    return await loop.run_in_executor(self._part_pool, self._send_part, key, upload_id, part)

            for part in streams:
                part.future = asyncio.ensure_future(send(part))
            etags = [await self._settle_part(part) for part in streams]
            await self._call("complete a multipart upload", self.client._complete_multipart_upload,
                             self.bucket, key, upload_id, [Part(p.number, etag) for p, etag in zip(streams, etags)])
            completed = True
        finally:
            if not completed:
                # Parts being sent finish (their bytes are all there); those not started never start.
                stopping = True
                await asyncio.shield(self._abort(key, creating, [p.future for p in streams if p.future]))

    def _put(self, key: str, data: bytes) -> None:
        # The low-level PUT takes bytes directly; put_object would wrap them in a stream and copy them again.
        self.client._put_object(self.bucket, key, data, {"Content-Type": "application/octet-stream"})

    async def _upload_multipart(self, chunks: AsyncIterator[bytes], size: int, sha256: str,
                                verify: Callable[[], None] | None) -> StoredBlob:
        key = blob_key(sha256)
        loop = asyncio.get_running_loop()
        # The upload is created while the first bytes arrive instead of before: one S3 round trip less.
        creating = asyncio.ensure_future(self._call("start a multipart upload", self.client._create_multipart_upload,
                                                    self.bucket, key, {}))
        upload_id: str | None = None
        parts: list[_PartStream] = []
        completed = False
        try:
            hasher = hashlib.sha256()
            received = 0
            current: _PartStream | None = None
            async for chunk in chunks:
                received += len(chunk)
                _check_not_too_long(received, size)
                hasher.update(chunk)
                view = memoryview(chunk)
                while view:
                    if current is None or current.remaining == 0:
                        if upload_id is None:
                            upload_id = await creating
                        number = len(parts) + 1
                        current = _PartStream(number, min(PART_BYTES, size - (number - 1) * PART_BYTES))
                        # Each part is sent while its bytes arrive (its size is known from the header), so S3
                        # writes overlap the gRPC receive instead of following it.
                        current.future = loop.run_in_executor(self._part_pool, self._send_part, key, upload_id,
                                                              current)
                        parts.append(current)
                    if current.future.done():
                        # Its sender failed (S3 went away): stop receiving now rather than queue the rest in memory.
                        await self._settle_part(current)
                    take = min(len(view), current.remaining)
                    current.feed(view[:take])
                    view = view[take:]
            _check_complete(received, size, hasher.hexdigest(), sha256)
            if verify is not None:
                verify()
            etags = [await self._settle_part(part) for part in parts]
            await self._call("complete a multipart upload", self.client._complete_multipart_upload,
                             self.bucket, key, upload_id, [Part(p.number, etag) for p, etag in zip(parts, etags)])
            completed = True
            return StoredBlob(sha256, size)
        finally:
            if not completed:
                for part in parts:
                    part.abort()
                # Shielded: the abort must run even when this upload was cancelled by its caller.
                await asyncio.shield(self._abort(key, creating, [p.future for p in parts]))

    async def _settle_part(self, part: _PartStream) -> str:
        try:
            return await part.future
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise errors.Unavailable(
                f"S3 at {self.endpoint} (bucket {self.bucket!r}) is unavailable while trying to upload part "
                f"{part.number}: {type(exc).__name__}: {exc}", reason="S3_UNAVAILABLE") from None
        except _UploadStopped as exc:
            raise errors.DeadlineExceeded(f"upload abandoned: {exc}", reason="PUBLISH_STALLED") from None

    def _send_part(self, key: str, upload_id: str, part: _PartStream) -> str:
        """UploadPart with a streamed body. minio signs the sha256 of a whole body, which is unknown until the
        part has arrived; S3 SigV4 allows UNSIGNED-PAYLOAD instead (integrity is our own sha256 check)."""
        client = self.client
        region = client._get_region(self.bucket)
        url = client._base_url.build(method="PUT", region=region, bucket_name=self.bucket, object_name=key,
                                     query_params={"partNumber": str(part.number), "uploadId": upload_id})
        date = minio_time.utcnow()
        headers = {"Host": url.netloc, "Content-Length": str(part.size), "x-amz-date": minio_time.to_amz_date(date),
                   "x-amz-content-sha256": "UNSIGNED-PAYLOAD", "Content-Type": "application/octet-stream"}
        creds = client._provider.retrieve()
        headers = sign_v4_s3(method="PUT", url=url, region=region, headers=headers, credentials=creds,
                             content_sha256="UNSIGNED-PAYLOAD", date=date)
        response = client._http.urlopen("PUT", urlunsplit(url), body=part.body(), headers=headers, retries=False,
                                        chunked=False, preload_content=True)
        if response.status != 200:
            raise errors.Unavailable(
                f"S3 at {self.endpoint} (bucket {self.bucket!r}) refused part {part.number}: HTTP {response.status} "
                f"{response.data[:300]!r}", reason="S3_ERROR")
        return response.headers.get("etag", "").strip('"')

    async def _abort(self, key: str, creating: asyncio.Future, in_flight: list[asyncio.Future]) -> None:
        # Parts still being sent would re-create state after the abort: let them finish (they were told to stop).
        await asyncio.gather(*in_flight, return_exceptions=True)
        try:
            upload_id = await creating
        except Exception:  # noqa: BLE001 - no upload was created, nothing to abort
            return
        try:
            await self._call("abort a multipart upload", self.client._abort_multipart_upload,
                             self.bucket, key, upload_id)
        except Exception as exc:  # noqa: BLE001 - best effort; S3 lifecycle rules or GC clean the rest
            log.warning("could not abort multipart upload %s of %s: %s", upload_id, key, exc)

    async def read(self, sha256: str, offset: int, chunk_size: int, hasher: Any = None) -> AsyncIterator[bytes]:
        """The blob's bytes from `offset`, in pieces of `chunk_size`; `hasher` (a hashlib object), when given, is
        fed every piece in order by the reading thread, off the event loop."""
        try:
            response = await self._call("read a blob", self.client.get_object, self.bucket, blob_key(sha256),
                                        offset)
        except S3Error as exc:
            if exc.code in _NOT_FOUND_CODES:
                raise errors.DataLoss(f"blob {sha256} is recorded but missing from bucket {self.bucket!r}",
                                      reason="BLOB_MISSING") from None
            raise
        # One thread per download reads the next pieces from S3 (and hashes them) while the caller sends the current
        # one; it alone touches the response, closing it too, so a caller that stops early never races a read.
        loop = asyncio.get_running_loop()
        ahead: asyncio.Queue[bytes | BaseException] = asyncio.Queue(READ_AHEAD_CHUNKS)
        stop = threading.Event()

        def hand_over(item: bytes | BaseException) -> None:
            asyncio.run_coroutine_threadsafe(ahead.put(item), loop).result(timeout=PART_STALL_SECONDS)

        def read_all() -> None:
            try:
                while not stop.is_set():
                    data = _read_exactly(response, chunk_size)
                    if hasher is not None:
                        hasher.update(data)
                    hand_over(data)
                    if not data:
                        return
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                if not stop.is_set():
                    with contextlib.suppress(BaseException):
                        hand_over(exc)
            finally:
                response.close()
                response.release_conn()

        threading.Thread(target=read_all, name=f"s3-read {sha256[:12]}", daemon=True).start()
        try:
            while True:
                data = await ahead.get()
                if isinstance(data, BaseException):
                    raise self._unavailable(data, "read a blob") from None
                if not data:
                    return
                yield data
        finally:
            stop.set()
            while not ahead.empty():  # frees a put the reading thread may be blocked in
                ahead.get_nowait()

    async def presigned_get(self, sha256: str, seconds: int) -> str:
        """A URL that GETs the blob without credentials for `seconds` (signed here; no S3 round trip once the
        bucket's region is known)."""
        return await self._call("sign a download URL", self.client.presigned_get_object, self.bucket,
                                blob_key(sha256), timedelta(seconds=seconds))

    async def remove(self, sha256: str) -> None:
        await self._call("delete a blob", self.client.remove_object, self.bucket, blob_key(sha256))

    async def list_blobs(self) -> list[StoredBlob]:
        def list_all() -> list[StoredBlob]:
            return [StoredBlob(obj.object_name[len(BLOB_PREFIX):], obj.size or 0)
                    for obj in self.client.list_objects(self.bucket, prefix=BLOB_PREFIX, recursive=True)]
        return await self._call("list blobs", list_all)

    async def abort_stale_uploads(self, older_than_seconds: float) -> int:
        """Aborts blob multipart uploads started more than `older_than_seconds` ago: what a crashed registry left."""
        def abort_old() -> int:
            cutoff = datetime.now(UTC) - timedelta(seconds=older_than_seconds)
            result = self.client._list_multipart_uploads(self.bucket, prefix=BLOB_PREFIX)
            stale = [u for u in result.uploads if u.initiated_time is None or u.initiated_time <= cutoff]
            for upload in stale:
                self.client._abort_multipart_upload(self.bucket, upload.object_name, upload.upload_id)
            return len(stale)
        return await self._call("abort stale multipart uploads", abort_old)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._part_pool.shutdown(wait=False, cancel_futures=True)


class _UploadStopped(Exception):
    pass


class _PartStream:
    """The bytes of one part, handed from the event loop to the thread that sends them."""

    def __init__(self, number: int, size: int):
        self.number = number
        self.size = size
        self.remaining = size
        self.future: asyncio.Future | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def feed(self, data: memoryview) -> None:
        self.remaining -= len(data)
        self._queue.put(data)

    def abort(self) -> None:
        self._queue.put(None)

    def body(self) -> Iterator[memoryview]:
        sent = 0
        while sent < self.size:
            try:
                data = self._queue.get(timeout=PART_STALL_SECONDS)
            except queue.Empty:
                raise _UploadStopped(f"no bytes for part {self.number} in {PART_STALL_SECONDS} s") from None
            if data is None:
                # Breaking off mid-body: S3 never receives a complete part.
                raise _UploadStopped(f"part {self.number} abandoned")
            sent += len(data)
            yield data


def _read_exactly(response: Any, count: int) -> bytes:
    # urllib3 may return short reads; gather a full chunk so the client sees uniform pieces.
    data = response.read(count)
    if len(data) in (0, count):
        return data
    pieces = [data]
    got = len(data)
    while got < count:
        more = response.read(count - got)
        if not more:
            break
        pieces.append(more)
        got += len(more)
    return b"".join(pieces)


def _check_not_too_long(received: int, size: int) -> None:
    if received > size:
        raise errors.InvalidArgument(
            f"chunk: received more bytes than header.size_bytes={size}", field="chunk", reason="SIZE_MISMATCH")


def _check_length(received: int, size: int) -> None:
    if received != size:
        raise errors.InvalidArgument(
            f"header.size_bytes: the stream ended after {received} of the announced {size} bytes",
            field="header.size_bytes", reason="SIZE_MISMATCH")


def _check_digest(actual_sha256: str, expected_sha256: str, field: str, announcer: str) -> None:
    if actual_sha256 != expected_sha256:
        raise errors.DataLoss(
            f"{field}: received bytes hash to {actual_sha256}, the {announcer} announced {expected_sha256}; "
            "nothing was committed", field=field, reason="DIGEST_MISMATCH")


def _check_complete(received: int, size: int, actual_sha256: str, expected_sha256: str) -> None:
    _check_length(received, size)
    _check_digest(actual_sha256, expected_sha256, "header.sha256", "header")
