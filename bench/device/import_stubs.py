"""Writes placeholder modules for packages inference-perf imports at start but a run with random
data, local report storage and no media never calls (issue 34; bench/device/clients.sh).

inference-perf 0.7.0's entry point imports every data generator and storage backend
(inference_perf/main.py): `datasets` (Hugging Face datasets, with pyarrow and pandas, 70 MB of
wheels), `boto3`/`botocore` (S3 reports), `google.cloud.storage`/`google.auth` (GCS reports) and
`av` (video synthesis). The device machine has none and a call carries 64 MiB, so each becomes a
module whose every name is a class that raises ImportError when used: a run that needed one fails
loudly instead of measuring something else. A package that is importable already is left alone.
Usage: python import_stubs.py DIR   (then put DIR last on PYTHONPATH)
"""
import importlib.util
import os
import sys

MODULES = [
    "datasets", "boto3", "botocore", "botocore.config", "av",
    "google.auth", "google.auth.transport", "google.auth.transport.requests",
    "google.cloud", "google.cloud.storage", "google.cloud.exceptions",
]

BODY = '''"""Placeholder for {name}, not carried to this machine (bench/device/import_stubs.py)."""


class _NotCarried(Exception):
    def __init__(self, *args, **kwargs):
        raise ImportError("{name} is not installed here: this run must not need it")


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (_NotCarried,), {{}})
'''


def present(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def main():
    root = sys.argv[1]
    for name in MODULES:
        top = name.split(".")[0]
        if present(top) and (top != "google" or present(name)):
            continue
        # `google` stays a namespace package (no __init__.py), so a real google.* still imports.
        path = os.path.join(root, *name.split("."))
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "__init__.py"), "w") as f:
            f.write(BODY.format(name=name))
        print("placeholder:", name)


if __name__ == "__main__":
    main()
