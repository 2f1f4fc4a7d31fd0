"""A real S3-compatible server on 127.0.0.1 for the upload tests and bench.py: moto's server in a
process of its own, reached through a TCP proxy that can be cut (the server gone, mid-transfer
too), restored and throttled. With auth=True it checks credentials (IAM): moto then rejects the
signature of any request with a '/' in its query string (getmoto/moto#5948), such as a listing
under a prefix, so only the start-of-run checks run against that one."""
import json
import os
import socket
import subprocess
import sys
import threading
import time


class Proxy:
    """Forwards 127.0.0.1:port to a target port; cut() drops every connection and refuses new
    ones until restore(); throttle(rate) limits it to rate bytes/s, both ways, a read at a time."""

    def __init__(self, target):
        self.target, self.up, self.rate, self.open = target, True, None, set()
        self.listener = socket.create_server(('127.0.0.1', 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def throttle(self, rate):
        self.rate = rate

    def accept(self):
        while True:
            client, _ = self.listener.accept()
            if not self.up:
                client.close()
                continue
            server = socket.create_connection(('127.0.0.1', self.target))
            self.open |= {client, server}
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self.pump, args=(src, dst), daemon=True).start()

    def pump(self, src, dst):
        try:
            # throttled, it passes at most `rate` bytes a second: 1 is a byte a second
            while self.up and (data := src.recv(min(16384, max(1, int(self.rate or 16384))))):
                if self.rate:
                    time.sleep(len(data) / self.rate)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            self.close(s)

    def close(self, s):
        self.open.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self):
        self.up = False
        for s in list(self.open):
            self.close(s)

    def restore(self):
        self.up = True


def free_port():
    with socket.create_server(('127.0.0.1', 0)) as s:
        return s.getsockname()[1]


def start(bucket='runs', auth=False):
    """The server and `bucket`. Without auth the key is random strings; with auth, the key of a
    user allowed s3:*, and any other key is refused. Returns (process, proxy, env): env is what a
    client needs (endpoint, key, region)."""
    import boto3
    port = free_port()
    env = dict(os.environ)
    if auth:
        env['INITIAL_NO_AUTH_ACTION_COUNT'] = '4'  # the 4 calls below go unchecked
    process = subprocess.Popen([sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p', str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(('127.0.0.1', port), 0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    endpoint = f'http://127.0.0.1:{port}'
    key = dict(AccessKeyId=os.urandom(10).hex().upper(), SecretAccessKey=os.urandom(20).hex())
    if auth:
        setup = dict(endpoint_url=endpoint, region_name='us-east-1', aws_access_key_id='setup-unchecked',
                     aws_secret_access_key='setup-unchecked')
        iam = boto3.client('iam', **setup)
        iam.create_user(UserName='trainer')
        policy = {'Version': '2012-10-17', 'Statement': [{'Effect': 'Allow', 'Action': 's3:*', 'Resource': '*'}]}
        iam.put_user_policy(UserName='trainer', PolicyName='s3', PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName='trainer')['AccessKey']
    proxy = Proxy(port)
    env = dict(AWS_ENDPOINT_URL=f'http://127.0.0.1:{proxy.port}', AWS_DEFAULT_REGION='us-east-1',
               AWS_ACCESS_KEY_ID=key['AccessKeyId'], AWS_SECRET_ACCESS_KEY=key['SecretAccessKey'])
    boto3.client('s3', **client_args(env)).create_bucket(Bucket=bucket)
    return process, proxy, env


def client_args(env):
    """boto3.client's arguments for the server env names."""
    return dict(endpoint_url=env['AWS_ENDPOINT_URL'], region_name=env['AWS_DEFAULT_REGION'],
                aws_access_key_id=env['AWS_ACCESS_KEY_ID'], aws_secret_access_key=env['AWS_SECRET_ACCESS_KEY'])
