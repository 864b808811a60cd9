"""modelfs: a FUSE filesystem over S3 / Alibaba OSS, tuned for loading model weights (read-only unless
--writable, for checkpoints).

The package is `fsmount`; the console script is `modelfs` (see `fsmount.cli`).
"""

import os

__version__ = "0.1.0"

# botocore signs with awscrt wherever awscrt is installed (boto3[crt], and often beside other tools), and that
# signer copies a bytearray body whole (io.BytesIO): every part of a --writable upload, outside the memory
# budget (4 writers of 32M parts peaked at 376 MiB under --memory-limit 256M, whose bound is 320). botocore's own
# signer hashes the buffer where it is, and it is the one the tests run. Set before anything imports botocore;
# an explicit BOTO_DISABLE_CRT=false keeps the CRT signer.
os.environ.setdefault("BOTO_DISABLE_CRT", "true")
