"""
Checkpoints that leave the machine: every checkpoint train.py writes is uploaded to
object storage in the background, and a run resumes from the newest complete one there:

    python train.py --upload_to=s3://bucket/run   # or gs://, hf://user/repo, file:///
    python train.py --init_from=s3://bucket/run   # anywhere, into an empty out_dir

Under the URL: ckpt_XXXXXXX/ (a checkpoint's files, its manifest.json last: one without
it is incomplete), as many as out_dir keeps; `latest` and `best` (their names, for
people); `owner`, the id of the run that owns the URL (kept across resumes), so that runs
never delete each other's checkpoints. Every name a listing gives, and every manifest
(checkpoint.damage), is checked before use. s3:// goes through boto3, any other URL
through fsspec (gcsfs for gs://, huggingface_hub for hf://), each imported only when a
URL needs it (requirements-remote.txt). Each operation (a listing, one file up or down)
ends within NANOBITNET_REMOTE_TIMEOUT seconds (900), however slowly the server answers:
the clients' own timeouts count per read. Credentials come from each cloud's own
environment and files (AWS_ACCESS_KEY_ID, ~/.aws, AWS_ENDPOINT_URL, ...); no message here
names them, and any such value found in an error is masked.
"""
import json
import os
import shutil
import sys
import threading
import time

import checkpoint
from hub import endpoint, hide_credentials, inside, plain_name, seconds, token_header, within

SECRET_WORDS = ('KEY', 'SECRET', 'TOKEN', 'PASSWORD', 'CREDENTIAL')
MANIFEST_BYTES = 1 << 20  # a manifest lists a few files: read only when under this
CKPT = checkpoint.NAME  # a checkpoint's folder, as checkpoint.save names it (ASCII digits)
OWNER = 'owner'


def masked(error):
    """An error as one line, with every credential-like environment value masked."""
    text = hide_credentials(f"{type(error).__name__}: {error}".splitlines()[0])
    for name, value in os.environ.items():
        if any(w in name.upper() for w in SECRET_WORDS) and len(value) >= 8:
            text = text.replace(value, '***')
    return text


class S3:
    """s3://bucket/prefix through boto3 (AWS, or any S3-compatible server)."""

    def __init__(self, url):
        import boto3
        from botocore.config import Config
        self.bucket, _, prefix = url.removeprefix('s3://').partition('/')
        self.prefix = prefix.strip('/') + '/' if prefix.strip('/') else ''
        # the retries are ours (with backoff): a dead server holds no thread for minutes
        config = Config(retries={'max_attempts': 1}, connect_timeout=5, read_timeout=60)
        self.client = boto3.client('s3', config=config)

    def check(self):
        self.client.head_bucket(Bucket=self.bucket)
        self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)

    def put(self, path, name):
        self.client.upload_file(path, self.bucket, self.prefix + name)

    def put_text(self, text, name):
        key = self.prefix + name
        self.client.put_object(Bucket=self.bucket, Key=key, Body=text.encode())

    def create_text(self, text, name):
        """put_text unless `name` exists: of two runs that try at once, one writes."""
        key = self.prefix + name
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=text.encode(),
                                   IfNoneMatch='*')
        except self.client.exceptions.ClientError as e:
            code = e.response['Error']['Code']
            if code == 'NotImplemented' and self.get_text(name) is None:
                self.put_text(text, name)  # a server without conditional writes
            elif code not in ('PreconditionFailed', 'ConditionalRequestConflict'):
                raise

    def get(self, name, path):
        self.client.download_file(self.bucket, self.prefix + name, path)

    def size(self, name):
        return self.client.head_object(Bucket=self.bucket, Key=self.prefix + name)['ContentLength']

    def get_text(self, name):
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)
            return reply['Body'].read(1024).decode(errors='replace')  # owner: a short id
        except self.client.exceptions.NoSuchKey:
            return None

    def names(self):
        pages = self.client.get_paginator('list_objects_v2').paginate(
            Bucket=self.bucket, Prefix=self.prefix)
        return [o['Key'][len(self.prefix):] for p in pages for o in p.get('Contents', [])]

    def delete(self, name):
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + name)


class Fsspec:
    """Any other URL fsspec knows: file://, gs:// (gcsfs), hf:// (huggingface_hub)."""

    def __init__(self, url):
        if url.startswith('hf://') and not token_header(endpoint()) and \
                os.environ.get('HF_TOKEN'):  # huggingface_hub would send it anyway
            raise ValueError(f"HF_ENDPOINT={hide_credentials(endpoint())} is plain http to "
                             "another machine, where HF_TOKEN would travel readable; use "
                             "https, or unset HF_TOKEN")
        import fsspec
        self.fs, self.root = fsspec.core.url_to_fs(url)

    def check(self):
        self.fs.makedirs(self.root, exist_ok=True)
        self.fs.ls(self.root)

    def put(self, path, name):
        self.fs.makedirs(os.path.dirname(f'{self.root}/{name}'), exist_ok=True)
        self.fs.put_file(path, f'{self.root}/{name}')

    def put_text(self, text, name):
        self.fs.pipe_file(f'{self.root}/{name}', text.encode())

    def create_text(self, text, name):
        """put_text unless `name` exists: of two runs that try at once, one writes."""
        path = f'{self.root}/{name}'
        try:
            with self.fs.open(path, 'xb') as f:
                f.write(text.encode())
        except FileExistsError:
            pass
        except (NotImplementedError, ValueError):  # a file system without exclusive create
            if not self.fs.exists(path):
                self.put_text(text, name)

    def get(self, name, path):
        self.fs.get_file(f'{self.root}/{name}', path)

    def size(self, name):
        return self.fs.size(f'{self.root}/{name}')

    def get_text(self, name):
        try:
            return self.fs.cat_file(f'{self.root}/{name}', end=1024).decode(errors='replace')
        except FileNotFoundError:
            return None

    def names(self):
        return [p[len(self.root) + 1:] for p in self.fs.find(self.root)]

    def delete(self, name):
        self.fs.rm_file(f'{self.root}/{name}')


class Timed:
    """A store whose every operation ends within NANOBITNET_REMOTE_TIMEOUT seconds, in a
    TimeoutError naming the URL and that setting (hub.within)."""

    def __init__(self, store, url):
        self.store, self.url = store, url
        self.limit = seconds('NANOBITNET_REMOTE_TIMEOUT', 900)

    def __getattr__(self, operation):  # store.put(...) runs as within(limit, ..., put, ...)
        call = getattr(self.store, operation)
        return lambda *args: within(self.limit, self.url, 'NANOBITNET_REMOTE_TIMEOUT',
                                    call, *args)


def listing(names):
    """A store's names as {checkpoint: its file names}, and the stray ones, never fetched
    or deleted: neither ckpt_XXXXXXX/<a plain file name> nor latest, best or owner."""
    files, stray = {}, []
    for name in names:
        folder, _, file = name.partition('/')
        try:
            usable = CKPT.fullmatch(folder) and plain_name(file)
        except ValueError:
            usable = None
        if usable:
            files.setdefault(folder, []).append(file)
        elif name not in ('latest', 'best', OWNER):
            stray.append(name)
    return files, stray


def open_store(url, run_id=None):
    """The store behind a URL, checked now: a missing bucket, a wrong credential or (given
    a run's id) a URL whose checkpoints belong to another run, or to no run, ends the run in
    one line before any training step. A URL without checkpoints is the run's to claim."""
    if url.startswith('file://'):  # a local prefix: never inside a checkpoint
        try:
            checkpoint.check_output(url.removeprefix('file://'), 'upload_to', made=True)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    inner = [part for part in url.split('/') if CKPT.fullmatch(part)]
    if inner:  # its files would be another run's checkpoint's: damaged
        raise SystemExit(f"error: {url} lies inside checkpoint folder {inner[0]}; "
                         "upload to a prefix of the run's own")
    try:
        store = Timed(S3(url) if url.startswith('s3://') else Fsspec(url), url)
        store.check()
        # claimed once, atomically: a second run never takes over a prefix another run
        # claimed, uploaded or not, even one that starts at the same moment
        if run_id and not listing(store.names())[0]:
            store.create_text(run_id, OWNER)
        owner = store.get_text(OWNER) if run_id else None
    except ImportError as e:
        raise SystemExit(f"error: {url} needs {e.name}: pip install -r requirements-remote.txt")
    except Exception as e:
        raise SystemExit(f"error: cannot use {url} ({masked(e)}); check the bucket, "
                         "the path and the credentials") from None
    if owner != run_id:
        raise SystemExit(f"error: {url} belongs to another run; set another "
                         f"--upload_to, or resume that run with --init_from={url} "
                         f"(a run that never uploaded: delete {url}/{OWNER})")
    return store


def upload(store, ckpt, kept, best, run_id):
    """One checkpoint: its files, manifest last; `latest` and `best`; then the checkpoints
    out_dir no longer keeps, manifest first. False when another run owns the URL now."""
    if store.get_text(OWNER) != run_id:
        return False
    name = os.path.basename(ckpt)
    for f in sorted(os.listdir(ckpt), key=lambda f: f == checkpoint.MANIFEST):
        store.put(os.path.join(ckpt, f), f'{name}/{f}')
    store.put_text(name, 'latest')
    if best:
        store.put_text(best, 'best')
    if store.get_text(OWNER) != run_id:  # asked again: no deletion can be undone
        return False
    remote = listing(store.names())[0]
    for old in sorted(set(remote) - set(kept) - {name}):
        for f in sorted(remote[old], key=lambda f: f != checkpoint.MANIFEST):
            store.delete(f'{old}/{f}')
    return True


class Uploader:
    """Uploads a run's checkpoints in a background thread, so that training does not wait.
    Each is staged first as hard links (the local folder may delete it meanwhile); a
    checkpoint that comes while another uploads waits, and a newer one replaces it. Network
    errors are retried with backoff; one that outlives the retries is one warning line, and
    the next checkpoint tries again."""

    def __init__(self, url, run_id, retries=4, backoff=1.0):
        self.url, self.run_id = url.rstrip('/'), run_id
        self.retries, self.backoff = retries, backoff
        self.store = open_store(self.url, run_id)
        self.lost = False
        self.wake = threading.Condition()
        self.pending, self.busy, self.closing, self.uploaded = None, False, False, None
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def submit(self, folder, step, best_step):
        """Queue checkpoint `step` of the run in `folder`, just saved."""
        name = f'ckpt_{step:07d}'
        kept = [os.path.basename(c) for c in checkpoint.checkpoints(folder)]
        best = f'ckpt_{best_step:07d}' if best_step else None
        staged = os.path.join(folder, '.upload', name)
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(os.path.join(folder, name), staged, copy_function=os.link)
        with self.wake:
            if self.pending:  # superseded before its turn
                shutil.rmtree(self.pending[0], ignore_errors=True)
            self.pending = (staged, kept, best)
            self.wake.notify_all()

    def loop(self):
        while True:
            with self.wake:
                self.wake.wait_for(lambda: self.pending or self.closing)
                if not self.pending:
                    return
                job, self.pending, self.busy = self.pending, None, True
            if not self.lost:  # another run took the URL: leave it alone
                self.attempt(*job)
            shutil.rmtree(job[0], ignore_errors=True)
            with self.wake:
                self.busy = False
                self.wake.notify_all()

    def wait(self):
        """Until every queued checkpoint is uploaded or given up."""
        with self.wake:
            self.wake.wait_for(lambda: not self.pending and not self.busy)

    def attempt(self, staged, kept, best):
        for i in range(self.retries + 1):
            try:
                if upload(self.store, staged, kept, best, self.run_id):
                    self.uploaded = os.path.basename(staged)
                    return
                self.lost = True
                print(f"warning: {self.url} belongs to another run now; this run "
                      "uploads nothing more there and deletes nothing", file=sys.stderr)
                return
            except Exception as e:  # the clients raise many kinds; each is retried
                error = masked(e)
            if i < self.retries:
                time.sleep(self.backoff * 2 ** i)
        print(f"warning: uploading {os.path.basename(staged)} to {self.url} failed after "
              f"{self.retries + 1} tries ({error}); training goes on, the next checkpoint "
              "tries again", file=sys.stderr)

    def close(self):
        """Wait for the last upload; say where it is."""
        self.wait()
        with self.wake:
            self.closing = True
            self.wake.notify_all()
        self.thread.join()
        where = f"{self.url}/{self.uploaded}" if self.uploaded else "nothing uploaded"
        print(f"uploads done: {where}")


def unlisted(store, ckpt, names, tmp):
    """Why a stored checkpoint cannot be the one its manifest lists, before any other file
    of it is read: a manifest past MANIFEST_BYTES, or a file the manifest does not list
    at its size; None when every size matches (the sha256s are checked after download)."""
    if store.size(f'{ckpt}/{checkpoint.MANIFEST}') > MANIFEST_BYTES:
        return f"its manifest is over {MANIFEST_BYTES:,} bytes"
    path = inside(tmp, checkpoint.MANIFEST)
    store.get(f'{ckpt}/{checkpoint.MANIFEST}', path)
    try:
        with open(path) as f:
            listed = json.load(f)
    except ValueError:
        listed = None
    if not isinstance(listed, dict):
        return "its manifest is no JSON object"
    for name in names:
        if name == checkpoint.MANIFEST:
            continue
        entry = listed.get(name)
        stored = store.size(f'{ckpt}/{name}')
        if not (isinstance(entry, list) and entry and entry[0] == stored):
            return f"{name} is not in its manifest at its stored size ({stored:,} bytes)"
    return None


def download_latest(url, folder):
    """Copy the newest complete checkpoint under `url` into `folder`, which holds none
    (else a resume would take the newest there), verified against its manifest before it
    is renamed into place; a damaged one is skipped for the one before. Returns its path."""
    held = checkpoint.checkpoints(folder)
    if held:
        name = os.path.basename(held[-1])
        raise SystemExit(f"error: {folder} already holds {name}; --init_from=URL starts "
                         "in an empty out_dir: set a new --out_dir, or --init_from=resume")
    url = url.rstrip('/')
    store = open_store(url)
    files, stray = listing(store.names())
    if stray:
        print(f"warning: skipping {len(stray)} name(s) under {url} that are not "
              f"a checkpoint's file, such as {stray[0]!r}", file=sys.stderr)
    complete = [ckpt for ckpt in files if checkpoint.MANIFEST in files[ckpt]]
    tmp = os.path.join(folder, '.tmp_download')  # ours: a killed download's is removed
    for ckpt in sorted(complete, reverse=True):
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            damage = unlisted(store, ckpt, files[ckpt], tmp)
            for f in files[ckpt] if damage is None else ():
                store.get(f'{ckpt}/{f}', inside(tmp, f))
        except Exception as e:  # the clients raise many kinds
            raise SystemExit(f"error: cannot download {url}/{ckpt} ({masked(e)}); "
                             "check the network and run again") from None
        damage = damage or checkpoint.damage(tmp)
        if damage is None:
            final = os.path.join(folder, ckpt)
            os.replace(tmp, final)
            print(f"downloaded {url}/{ckpt} to {final}")
            return final
        print(f"warning: {url}/{ckpt} is damaged ({damage}); trying the one before",
              file=sys.stderr)
        shutil.rmtree(tmp)
    raise SystemExit(f"error: no complete checkpoint under {url}; train first, or set "
                     "--init_from=scratch")
