"""
Downloads from the Hugging Face hub (or any HTTPS server) with nothing but `requests`.

A hub file is a plain HTTPS GET of `{endpoint}/{repo}/resolve/{revision}/{file}`:
redirects followed, a stalled or cut transfer resumed with a Range header, the file renamed
into place once it matches the sha256 the hub sends for large (LFS) files. `HF_ENDPOINT`
points elsewhere (a mirror, or the tests' server on 127.0.0.1), `HF_TOKEN` reads gated
repos and goes only in the Authorization header (never printed) to HF_ENDPOINT's own host
and port. `HF_HUB_OFFLINE=1` forbids the network. A reply's headers must arrive within
NANOBITNET_HUB_TIMEOUT seconds (60), its body at 64 KiB per 30 s or faster. Under
torchrun only local rank 0 downloads; the other ranks wait for the file to appear.

Files are cached under ~/.cache/nanobitnet (or NANOBITNET_CACHE). `resolve_model` turns
a hub id into a local Hugging Face directory: config.json, the safetensors weights (one
file or shards), and the tokenizer files.
"""
import hashlib
import json
import os
import math
import re
import threading
import time
import urllib.parse

import requests
import urllib3  # requests' own transport, installed with it: its read errors are raised here

from report import Progress

# the files of a model's tokenizer and chat template, which travel with its weights
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja')
# fewer than STALL_BYTES in STALL_SECONDS (or a silent read that long) ends a try: stalled
STALL_BYTES, STALL_SECONDS = 1 << 16, 30.0
# a whole download, from its request on, gets the header limit plus its size at MIN_RATE
# bytes a second; a reply that states no size counts as its cap: a hub repo's files past
# 10 MB are LFS files, which state theirs; any other URL's, 1 GiB
MIN_RATE = 100 * 1024
HUB_UNSIZED, URL_UNSIZED = 10 * 2 ** 20, 2 ** 30


class DownloadError(OSError):
    """A file that cannot be fetched; `status` is the HTTP status when there was one."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


def plain_name(name, what='file name'):
    """A name from outside (an object key's part, a manifest entry, a shard name) checked
    to be one plain file name: no folder separator, no '..', no query or fragment mark, no
    drive, no control character, nothing hidden or empty; else a ValueError naming it."""
    bad = (not isinstance(name, str) or name in ('', '.', '..') or name.startswith('.')
           or any(c in name for c in '/\\?#:') or not name.isprintable()
           or name != name.strip())
    if bad:
        raise ValueError(f"{what} {name!r} is not a plain file name; refusing it")
    return name


def inside(folder, name, what='file name'):
    """folder/name for a plain `name`, resolved and checked to stay inside `folder`."""
    path = os.path.realpath(os.path.join(folder, plain_name(name, what)))
    if os.path.dirname(path) != os.path.realpath(folder):
        raise ValueError(f"{what} {name!r} leads out of {folder}; refusing it")
    return path


def seconds(setting, default):
    """A time limit from the environment: a finite positive number of seconds."""
    text = os.environ.get(setting, str(default))
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{setting}={text!r} is not a number of seconds above 0; fix it")
    return value


def within(limit, server, setting, call, *args, **kwargs):
    """call(*args, **kwargs) given `limit` seconds in all. A server that answers a byte at
    a time keeps every per-read timeout happy, so the whole wait is timed here: the call
    runs in a daemon thread, and past the limit a TimeoutError names the server and the
    setting that raises the limit (the call is left to end on its own)."""
    outcome = {}

    def run():
        try:
            outcome['value'] = call(*args, **kwargs)
        except BaseException as e:  # handed to the caller
            outcome['error'] = e
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        shown = hide_credentials(server)
        raise TimeoutError(f"{shown} did not answer within {limit:g}s; check it, or set "
                           f"{setting}=SECONDS higher")
    if 'error' in outcome:
        raise outcome['error']
    return outcome['value']


def cache_dir():
    return (os.environ.get('NANOBITNET_CACHE')
            or os.path.expanduser('~/.cache/nanobitnet'))


def local_rank():
    return int(os.environ.get('LOCAL_RANK', 0))  # set by torchrun before torch.distributed is up


def wait_for(path, what, timeout):
    """The other local ranks wait for rank 0's result: a file renamed into place."""
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for local rank 0 to {what}; see its error")
        time.sleep(0.2)
    return path


def linked_sha256(response):
    """The hub's sha256 of an LFS file: X-Linked-Etag (on the redirect) or ETag."""
    for r in (*response.history, response):
        for header in ('X-Linked-Etag', 'ETag'):
            tag = r.headers.get(header, '').strip('W/"')
            if re.fullmatch('[0-9a-f]{64}', tag):
                return tag
    return None


def linked_size(response):
    """The hub's size of an LFS file (X-Linked-Size, on the redirect), or None."""
    for r in (*response.history, response):
        size = r.headers.get('X-Linked-Size', '')
        if size.isdecimal():
            return int(size)
    return None


# what in a URL is a credential: a password in its user part, and the query values that
# sign or authorize a request (S3's and other presigned URLs, tokens in the query)
PASSWORD = re.compile(r'(//[^/@\s:]*):[^/@\s]*@')
SIGNED = ('x-amz-signature', 'x-amz-credential', 'x-amz-security-token', 'signature', 'sig',
          'token', 'access_token', 'api_key', 'apikey', 'key', 'password')
SIGNATURE = re.compile(rf"([?&](?:{'|'.join(SIGNED)})=)[^&#\s]*", re.I)


def hide_credentials(text):
    """text with every URL's password and signing query values as ***: what may be
    printed, logged or saved (a URL's credentials are the user's, and logs and
    checkpoints travel)."""
    return SIGNATURE.sub(r'\1***', PASSWORD.sub(r'\1:***@', text))


def settings_shown(value):
    """Settings (a dict, list or tuple of them, or one) with hide_credentials applied to
    every string: the settings a run prints, logs and saves in its checkpoints."""
    if isinstance(value, str):
        return hide_credentials(value)
    if isinstance(value, dict):
        return {k: settings_shown(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(settings_shown(v) for v in value)
    return value


def endpoint():
    return os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/')


def token_header(url):
    """HF_TOKEN for the hub's own scheme, host and port only (a data file's URL may point
    anywhere), and over https only unless the hub is on this machine (a mirror, the tests)."""
    token = os.environ.get('HF_TOKEN')
    hub, to = urllib.parse.urlsplit(endpoint()), urllib.parse.urlsplit(url)
    private = hub.scheme == 'https' or hub.hostname in ('127.0.0.1', 'localhost', '::1')
    same = (to.scheme, to.hostname, to.port) == (hub.scheme, hub.hostname, hub.port)
    # requests itself drops the header when a redirect leaves that host or port
    return {'Authorization': f"Bearer {token}"} if token and private and same else {}


def chunks(response):
    """A response's bytes as they arrive (read1 does not wait for a full chunk), the clock
    checked after every read: a read timeout alone never trips on a byte a second."""
    start, moved = time.monotonic(), 0
    while chunk := response.raw.read1(1 << 16):
        yield chunk
        moved += len(chunk)
        if moved >= STALL_BYTES:
            start, moved = time.monotonic(), 0
        elif time.monotonic() - start > STALL_SECONDS:
            raise requests.ReadTimeout(f"stalled: under {STALL_BYTES} bytes in {STALL_SECONDS}s")


def download(url, dest, timeout=60, wait=3600, tries=3, unsized=URL_UNSIZED):
    """Fetch url to dest once (a file already there is kept); returns dest. A reply
    that states no size may send at most `unsized` bytes; each try ends by its deadline
    (MIN_RATE)."""
    if os.path.exists(dest):
        return dest
    shown = hide_credentials(url)  # in every message
    if local_rank() != 0:
        return wait_for(dest, f"download {shown}", wait)
    local = "or download it yourself and pass its local path"
    if os.environ.get('HF_HUB_OFFLINE', '0') not in ('0', ''):
        raise DownloadError(f"{shown} is not at {dest} and HF_HUB_OFFLINE is set; "
                            f"unset it, {local}")
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part = dest + '.part'
    # identity: the bytes as stored, so that Range offsets and the sha256 are the file's
    auth = {**token_header(url), 'Accept-Encoding': 'identity'}
    header_limit = seconds('NANOBITNET_HUB_TIMEOUT', 60)
    for attempt in range(tries):
        time.sleep(attempt)
        have = os.path.getsize(part) if os.path.exists(part) else 0
        headers = {**auth, 'Range': f'bytes={have}-'} if have else auth
        try:
            limits = (timeout, STALL_SECONDS)  # to connect; between two reads
            requested = time.monotonic()
            try:  # the status and headers: in time, however slowly they trickle
                reply = within(header_limit, url, 'NANOBITNET_HUB_TIMEOUT', requests.get,
                               url, headers=headers, stream=True, timeout=limits)
            except TimeoutError as e:
                raise DownloadError(f"{e}, {local}") from None
            with reply as r:
                sha = linked_sha256(r)
                code = r.status_code
                if code in (401, 403):
                    raise DownloadError(f"{shown}: HTTP {code}, not authorized; "
                                        f"gated/private repo? set HF_TOKEN to a token "
                                        f"that can read it, {local}", code)
                if code == 404:
                    raise DownloadError(f"{shown}: HTTP 404, not found; check the repo "
                                        f"id, revision and file name, {local}", 404)
                # the part already holds the whole file: a crash came before the rename
                if code == 416:
                    break
                if code >= 400:
                    message = f"{shown}: HTTP {code}; try again later, {local}"
                    raise DownloadError(message, code)
                if code != 206:
                    have = 0  # 200: the server ignored the Range
                # the whole file's size: the hub's for a large (LFS) file, else what
                # this reply announces after the bytes we have; 0 when neither is given
                announced = r.headers.get('Content-Length', '')
                size = have + int(announced) if announced.isdecimal() else 0
                size = linked_size(r) or size
                most = size or unsized
                limit = header_limit + most / MIN_RATE
                show = Progress(f"download {os.path.basename(dest)}", size, start=have)
                with open(part, 'ab' if have else 'wb') as f:
                    for chunk in chunks(r):
                        f.write(chunk)
                        have += len(chunk)
                        show(have)
                        if have > most:  # never past what it announced, or the cap
                            os.remove(part)
                            said = 'a reply of no stated size may send'
                            said = 'it announced' if size else said
                            raise DownloadError(f"{shown} sends more than the {most:,} "
                                                f"bytes {said}; {local}")
                        if time.monotonic() - requested > limit:
                            slowest = f"{MIN_RATE // 1024} KiB/s"
                            raise DownloadError(f"{shown} did not arrive within {limit:.0f}s "
                                                f"(at {slowest} at least); check the server, "
                                                f"or set NANOBITNET_HUB_TIMEOUT higher, {local}")
                show(have, last=True)
            break
        except (requests.ConnectionError, requests.Timeout, urllib3.exceptions.HTTPError) as e:
            err = type(e).__name__  # a cut transfer: next try resumes from what arrived
    else:
        raise DownloadError(f"cannot download {shown} ({err}); check network, HF_ENDPOINT, "
                            f"{local}")
    if sha:
        with open(part, 'rb') as f:
            got = hashlib.file_digest(f, 'sha256').hexdigest()
        if got != sha:
            os.remove(part)
            raise DownloadError(f"{shown}: sha256 {got[:16]}... is not the hub's {sha[:16]}...; "
                                f"the corrupt file was deleted, run again")
    os.replace(part, dest)
    return dest


def hub_file(repo_id, filename, repo_type='model', revision='main'):
    """A hub repo's file: its URL (quoted: a '%' or space stays in the path) and its cache
    path. Each part (owner, name, revision, the file's folders) must be a plain name."""
    owner, _, name = repo_id.partition('/')
    *parts, base = [owner, name, revision, *filename.split('/')]
    what = f"in hub file {repo_id}@{revision}/{filename}, part"
    folder = os.path.join(cache_dir(), repo_type + 's', *[plain_name(p, what) for p in parts])
    kind = 'datasets/' if repo_type == 'dataset' else ''
    path = urllib.parse.quote(f"{kind}{repo_id}/resolve/{revision}/{filename}")
    return f"{endpoint()}/{path}", inside(folder, base, what)


def hub_download(repo_id, filename, repo_type='model', revision='main'):
    """A file of a hub repo (model or dataset), cached under cache_dir()."""
    url, dest = hub_file(repo_id, filename, repo_type, revision)
    return download(url, dest, unsized=HUB_UNSIZED)


def fetch(src, folder=None):
    """A data file given as a local path, a URL, or
    hf://datasets/owner/name[@revision]/file (hf://owner/name/file for a model repo):
    its local path, downloaded (into folder) if need be."""
    m = re.fullmatch(r'hf://(datasets/)?([^/@]+/[^/@]+)(?:@([^/]+))?/(.+)', src)
    if m:
        kind = 'dataset' if m[1] else 'model'
        url, dest = hub_file(m[2], m[4], kind, m[3] or 'main')
    elif src.startswith(('http://', 'https://')):
        url = src
        # its host and path, and a hash of the whole URL: never a credential in a name
        parts = urllib.parse.urlsplit(src)
        plain = re.sub(r'[^\w.-]', '_', f"{parts.hostname}{parts.path}")[-120:]
        digest = hashlib.sha256(src.encode()).hexdigest()[:12]
        dest = inside(os.path.join(cache_dir(), 'urls'), f"{digest}-{plain}",
                      'URL as a file name')
    elif os.path.exists(src):
        return src
    else:
        raise FileNotFoundError(f"data file {src!r} not found; give a local path, "
                                f"an https:// URL or hf://datasets/owner/name/file")
    if folder:
        dest = os.path.join(folder, os.path.basename(dest))
    return download(url, dest, unsized=HUB_UNSIZED if m else URL_UNSIZED)


def shard_names(index, repo_id):
    """The weight files a sharded model's index lists, each a plain file name: a '../' in
    one would pick where we write, a '?' (which ends a URL's path) which file we fetch."""
    with open(index) as f:
        listed = json.load(f)
    weight_map = listed.get('weight_map') if isinstance(listed, dict) else None
    names = list(weight_map.values()) if isinstance(weight_map, dict) else [None]
    what = f"refusing hub repo {repo_id}: in its index's weight_map, the shard"
    return sorted({plain_name(name, what) for name in names})


def resolve_model(src, revision='main'):
    """A Hugging Face model directory: src itself if it is one, else the hub repo src
    fetched into the cache (config.json, the safetensors weights, single or sharded, the
    tokenizer files)."""
    if os.path.isdir(src):
        return src
    if not re.fullmatch(r'[\w.-]+/[\w.-]+', src):
        raise FileNotFoundError(f"{src!r} is neither a model directory nor a hub id (owner/name)")
    # the repo's folder in the cache, its id and revision checked on the way
    folder = os.path.dirname(hub_file(src, 'config.json', 'model', revision)[1])
    done = os.path.join(folder, '.complete')  # which files exist is known only to rank 0
    if os.path.exists(done) or local_rank() != 0:
        wait_for(done, f"download {src}", 3600)
        return folder

    def get(name, optional=False):
        try:
            return hub_download(src, name, 'model', revision)
        except DownloadError as e:
            if not (optional and e.status == 404):
                raise

    get('config.json')
    index = get('model.safetensors.index.json', optional=True)
    weights = shard_names(index, src) if index else ['model.safetensors']
    for name in weights:
        get(name)
    for name in TOKENIZER_FILES:
        get(name, optional=True)
    open(done, 'w').close()
    return folder
