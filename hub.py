"""
Downloads from the Hugging Face hub (or any HTTPS server) with nothing but `requests`.

A hub file is a plain HTTPS GET of `{endpoint}/{repo}/resolve/{revision}/{file}`:
redirects followed, a cut transfer resumed with a Range header, the file written under a
temporary name and renamed once it matches the sha256 the hub sends for large (LFS)
files. `HF_ENDPOINT` points elsewhere (a mirror, or the tests' server on 127.0.0.1),
`HF_TOKEN` reads gated repos and is sent only in the Authorization header (never
printed), `HF_HUB_OFFLINE=1` forbids the network. Under torchrun only local rank 0
downloads; the other ranks wait for the file to appear.

Files are cached under ~/.cache/nanobitnet (or NANOBITNET_CACHE). `resolve_model` turns
a hub id into a local Hugging Face directory: config.json, the safetensors weights (one
file or shards), and the tokenizer files. `Progress` is the one progress line every long
job here prints.
"""
import hashlib
import json
import os
import re
import sys
import time

import requests

# the files of a model's tokenizer and chat template, which travel with its weights
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja')


class Progress:
    """One progress line for long work (downloads, preparing data, evaluation):
    rewritten in place on a terminal, a new line every `every` seconds otherwise, so that
    logs stay readable; nothing for work that ends within `delay` seconds. Amounts are in
    `unit`s of `scale` (MB: 1e6)."""

    def __init__(self, what, total=0, unit=' MB', scale=1e6, start=0, delay=2.0,
                 every=10.0):
        self.what, self.total, self.start = what, total, start
        self.unit, self.scale = unit, scale
        self.tty, self.every = sys.stdout.isatty(), every
        self.t0, self.shown, self.delay = time.time(), 0.0, delay

    def __call__(self, done, extra='', last=False):
        now = time.time()
        if now - self.t0 < self.delay:
            return
        if not last and now - self.shown < (0.5 if self.tty else self.every):
            return
        self.shown = now
        rate = (done - self.start) / (now - self.t0)
        f = ',.1f' if self.scale > 1 else ',.0f'
        line = f"{self.what}: {done / self.scale:{f}}"
        if self.total:
            line += f" / {self.total / self.scale:{f}}"
        line += f"{self.unit}{extra}, {rate / self.scale:,.1f}{self.unit}/s"
        if self.total and not last and rate > 0:
            line += f", ETA {(self.total - done) / rate:.0f}s"
        end = '\n' if last or not self.tty else ''
        print(f"\r{line}\033[K" if self.tty else line, end=end, flush=True)


class DownloadError(OSError):
    """A file that cannot be fetched; `status` is the HTTP status when there was one."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


def plain_name(name, what='file name'):
    """A name from outside (an object key's part, a manifest entry, a shard name) checked
    to be one plain file name: no folder separator, no '..', no query or fragment mark, no
    drive, nothing hidden or empty. Raises ValueError that says what came."""
    bad = (not isinstance(name, str) or name in ('', '.', '..') or name.startswith('.')
           or any(c in name for c in '/\\?#:\0') or name != name.strip())
    if bad:
        raise ValueError(f"{what} {name!r} is not a plain file name; refusing it")
    return name


def inside(folder, name, what='file name'):
    """folder/name for a plain `name`, resolved and checked to stay inside `folder`."""
    path = os.path.realpath(os.path.join(folder, plain_name(name, what)))
    if os.path.dirname(path) != os.path.realpath(folder):
        raise ValueError(f"{what} {name!r} leads out of {folder}; refusing it")
    return path


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


def download(url, dest, timeout=60, wait=3600, tries=3):
    """Fetch url to dest once (a file already there is kept); returns dest."""
    if os.path.exists(dest):
        return dest
    if local_rank() != 0:
        return wait_for(dest, f"download {url}", wait)
    local = "or download it yourself and pass its local path"
    if os.environ.get('HF_HUB_OFFLINE', '0') not in ('0', ''):
        raise DownloadError(f"{url} is not at {dest} and HF_HUB_OFFLINE is set; unset it, {local}")
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part = dest + '.part'
    auth = {}
    if os.environ.get('HF_TOKEN'):
        auth['Authorization'] = f"Bearer {os.environ['HF_TOKEN']}"
    for attempt in range(tries):
        have = os.path.getsize(part) if os.path.exists(part) else 0
        headers = {**auth, 'Range': f'bytes={have}-'} if have else auth
        try:
            with requests.get(url, headers=headers, stream=True, timeout=timeout) as r:
                sha = linked_sha256(r)
                code = r.status_code
                if code in (401, 403):
                    raise DownloadError(f"{url}: HTTP {code}, not authorized; "
                                        f"gated/private repo? set HF_TOKEN to a token "
                                        f"that can read it, {local}", code)
                if code == 404:
                    raise DownloadError(f"{url}: HTTP 404, not found; check the repo "
                                        f"id, revision and file name, {local}", 404)
                # the part already holds the whole file: a crash came before the rename
                if code == 416:
                    break
                if code >= 400:
                    message = f"{url}: HTTP {code}; try again later, {local}"
                    raise DownloadError(message, code)
                if code != 206:
                    have = 0  # 200: the server ignored the Range
                size = have + int(r.headers.get('Content-Length', 0))
                show = Progress(f"download {os.path.basename(dest)}", size, start=have)
                with open(part, 'ab' if have else 'wb') as f:
                    for chunk in r.iter_content(1 << 16):
                        f.write(chunk)
                        have += len(chunk)
                        show(have)
                show(have, last=True)
            break
        except (requests.ConnectionError, requests.Timeout,
                requests.exceptions.ChunkedEncodingError) as e:
            err = type(e).__name__  # a cut transfer: next try resumes from what arrived
            time.sleep(attempt)
    else:
        raise DownloadError(f"cannot download {url} ({err}); check network, HF_ENDPOINT, {local}")
    if sha:
        with open(part, 'rb') as f:
            got = hashlib.file_digest(f, 'sha256').hexdigest()
        if got != sha:
            os.remove(part)
            raise DownloadError(f"{url}: sha256 {got[:16]}... is not the hub's {sha[:16]}...; "
                                f"the corrupt file was deleted, run again")
    os.replace(part, dest)
    return dest


def hub_url(repo_id, filename, repo_type='model', revision='main'):
    endpoint = os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/')
    kind = 'datasets/' if repo_type == 'dataset' else ''
    return f"{endpoint}/{kind}{repo_id}/resolve/{revision}/{filename}"


def hub_download(repo_id, filename, repo_type='model', revision='main'):
    """A file of a hub repo (model or dataset), cached under cache_dir()."""
    dest = os.path.join(cache_dir(), repo_type + 's', repo_id, revision, filename)
    return download(hub_url(repo_id, filename, repo_type, revision), dest)


def fetch(src, folder=None):
    """A data file given as a local path, a URL, or
    hf://datasets/owner/name[@revision]/file (hf://owner/name/file for a model repo):
    its local path, downloaded (into folder) if need be."""
    m = re.fullmatch(r'hf://(datasets/)?([^/@]+/[^/@]+)(?:@([^/]+))?/(.+)', src)
    if m:
        kind = 'dataset' if m[1] else 'model'
        repo, revision, name = m[2], m[3] or 'main', m[4]
        url = hub_url(repo, name, kind, revision)
        dest = os.path.join(cache_dir(), kind + 's', repo, revision, name)
    elif src.startswith(('http://', 'https://')):
        url = src
        name = re.sub(r'[^\w.-]', '_', src.split('://', 1)[1])
        dest = os.path.join(cache_dir(), 'urls', name)
    elif os.path.exists(src):
        return src
    else:
        raise FileNotFoundError(f"data file {src!r} not found; give a local path, "
                                f"an https:// URL or hf://datasets/owner/name/file")
    if folder:
        dest = os.path.join(folder, os.path.basename(dest))
    return download(url, dest)


def resolve_model(src, revision='main'):
    """A Hugging Face model directory: src itself if it is one, else the hub repo src
    fetched into the cache (config.json, the safetensors weights, single or sharded, the
    tokenizer files)."""
    if os.path.isdir(src):
        return src
    if not re.fullmatch(r'[\w.-]+/[\w.-]+', src):
        raise FileNotFoundError(f"{src!r} is neither a model directory nor a hub id (owner/name)")
    folder = os.path.join(cache_dir(), 'models', src, revision)
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
    weights = ['model.safetensors']
    if index:
        with open(index) as f:
            weights = sorted(set(json.load(f)['weight_map'].values()))
    for name in weights:
        get(name)
    for name in TOKENIZER_FILES:
        get(name, optional=True)
    open(done, 'w').close()
    return folder
