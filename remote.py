"""
Checkpoints that leave the machine: every checkpoint train.py writes is uploaded to
object storage in the background, and a run resumes from the newest complete one there:

    python train.py --upload_to=s3://bucket/run   # or gs://, hf://user/repo, file:///
    python train.py --init_from=s3://bucket/run   # anywhere, the local out_dir gone

Under the URL: ckpt_XXXXXXX/ (a checkpoint's files, its manifest.json last, so that a
checkpoint without one is incomplete), then `latest` and `best` (the names of those
checkpoints); the remote keeps the checkpoints the local out_dir keeps. s3:// goes
through boto3, any other URL through fsspec (gcsfs for gs://, huggingface_hub for
hf://): the clients are imported only when a URL needs one (requirements-remote.txt).
Credentials come from each cloud's own environment and files (AWS_ACCESS_KEY_ID, ~/.aws,
AWS_ENDPOINT_URL, ...); no message here names them, and any such value found in an error
is masked.
"""
import os
import shutil
import sys
import threading
import time

import checkpoint

SECRET_WORDS = ('KEY', 'SECRET', 'TOKEN', 'PASSWORD', 'CREDENTIAL')


def masked(error):
    """An error as one line, with every credential-like environment value masked."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
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

    def get(self, name, path):
        self.client.download_file(self.bucket, self.prefix + name, path)

    def names(self):
        pages = self.client.get_paginator('list_objects_v2').paginate(
            Bucket=self.bucket, Prefix=self.prefix)
        return [o['Key'][len(self.prefix):] for p in pages for o in p.get('Contents', [])]

    def delete(self, name):
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + name)


class Fsspec:
    """Any other URL fsspec knows: file://, gs:// (gcsfs), hf:// (huggingface_hub)."""

    def __init__(self, url):
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

    def get(self, name, path):
        self.fs.get_file(f'{self.root}/{name}', path)

    def names(self):
        return [p[len(self.root) + 1:] for p in self.fs.find(self.root)]

    def delete(self, name):
        self.fs.rm_file(f'{self.root}/{name}')


def open_store(url):
    """The store behind a URL, checked now: a missing bucket or a wrong credential ends
    the run in one line, before any training step."""
    try:
        store = S3(url) if url.startswith('s3://') else Fsspec(url)
        store.check()
    except ImportError as e:
        raise SystemExit(f"error: {url} needs {e.name}: pip install -r requirements-remote.txt")
    except Exception as e:
        raise SystemExit(f"error: cannot use {url} ({masked(e)}); check the bucket, "
                         "the path and the credentials") from None
    return store


def upload(store, ckpt, kept, best):
    """One checkpoint: its files, its manifest last; then `latest` and `best`; then the
    remote checkpoints the local folder no longer keeps, manifest first."""
    name = os.path.basename(ckpt)
    files = sorted(os.listdir(ckpt), key=lambda f: f == checkpoint.MANIFEST)
    for f in files:
        store.put(os.path.join(ckpt, f), f'{name}/{f}')
    store.put_text(name, 'latest')
    if best:
        store.put_text(best, 'best')
    keep = set(kept) | {name}
    gone = [n for n in store.names() if n.startswith('ckpt_') and n.split('/')[0] not in keep]
    for n in sorted(gone, key=lambda n: not n.endswith(checkpoint.MANIFEST)):
        store.delete(n)


class Uploader:
    """Uploads a run's checkpoints in a background thread, so that training does not wait.
    Each is staged first as hard links (the local folder may delete it meanwhile); a
    checkpoint that comes while another uploads waits, and a newer one replaces it. Network
    errors are retried with backoff; one that outlives the retries is one warning line, and
    the next checkpoint tries again."""

    def __init__(self, url, retries=4, backoff=1.0):
        self.url, self.retries, self.backoff = url.rstrip('/'), retries, backoff
        self.store = open_store(url)
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
                upload(self.store, staged, kept, best)
                self.uploaded = os.path.basename(staged)
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


def download_latest(url, folder):
    """Copy the newest complete checkpoint under `url` into `folder`, verified against its
    manifest; a damaged one is skipped for the one before. Returns its local path."""
    store = open_store(url)
    names = store.names()
    complete = {n.split('/')[0] for n in names if n.endswith('/' + checkpoint.MANIFEST)}
    for ckpt in sorted(complete, reverse=True):
        tmp, final = os.path.join(folder, '.tmp_' + ckpt), os.path.join(folder, ckpt)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for n in [n for n in names if n.startswith(ckpt + '/')]:
            store.get(n, os.path.join(tmp, n[len(ckpt) + 1:]))
        damage = checkpoint.damage(tmp)
        if damage is None:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            print(f"downloaded {url.rstrip('/')}/{ckpt} to {final}")
            return final
        print(f"warning: {url.rstrip('/')}/{ckpt} is damaged ({damage}); trying the one "
              "before", file=sys.stderr)
        shutil.rmtree(tmp)
    raise SystemExit(f"error: no complete checkpoint under {url}; train first, or set "
                     "--init_from=scratch")
