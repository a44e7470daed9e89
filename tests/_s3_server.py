"""A real S3 API for the tests: moto's server on 127.0.0.1, reached over HTTP by s3fs.

Nothing is mocked: s3fs signs and sends real requests; moto answers them like
S3 does (conditional writes included). One server per test session; each test
gets its own bucket, so tests never see each other's objects.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class Bucket:
    """One test bucket: its URL, the endpoint, and the options/environment that reach it."""

    name: str
    endpoint: str
    options: dict[str, Any] = field(default_factory=dict)

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.name}/{prefix}"

    def env(self) -> dict[str, str]:
        """The standard variables a child process (or boto3) reads to find this store."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.options)


def options_for(endpoint: str, key: str = "testing", secret: str = "testing") -> dict[str, Any]:
    return {
        "key": key,
        "secret": secret,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def read_only_options(bucket: Bucket) -> dict[str, Any]:
    """Credentials of a new IAM user allowed only s3:Get*, s3:List*, s3:Describe* (AWS's read-only policy)."""
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=bucket.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    user = f"reader-{bucket.name}"
    iam.create_user(UserName=user)
    arns = [f"arn:aws:s3:::{bucket.name}", f"arn:aws:s3:::{bucket.name}/*"]
    allow = {"Effect": "Allow", "Action": ["s3:Get*", "s3:List*", "s3:Describe*"], "Resource": arns}
    policy = {"Version": "2012-10-17", "Statement": [allow]}
    iam.put_user_policy(UserName=user, PolicyName="read-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    return options_for(bucket.endpoint, key=key["AccessKeyId"], secret=key["SecretAccessKey"])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Start moto's S3 server on a free port of 127.0.0.1 for the session; stop it after."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> Bucket:
    """A fresh, empty bucket on the session's server."""
    bucket = Bucket(f"t-{uuid.uuid4().hex[:20]}", s3_endpoint, options_for(s3_endpoint))
    bucket.fs().call_s3("create_bucket", Bucket=bucket.name)
    return bucket
