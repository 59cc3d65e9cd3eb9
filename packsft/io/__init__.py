"""Files on disk: atomic writes of files and folders (:mod:`packsft.io.files`) and the publish journal that renames a
set of files as one unit (:mod:`packsft.io.journal`). Every name is importable from ``packsft.io``."""

from packsft.io.files import (
    HashingWriter,
    atomic_dir,
    atomic_open,
    check_writable_dir,
    exchange_paths,
    file_blake2b,
    foreign_entries,
    fsync_dir,
    fsync_tree,
    missing_file,
    os_error_text,
    read_json_object,
    replace_dir,
    stale_temps,
    temp_path,
    write_json_atomic,
)
from packsft.io.journal import (
    JOURNAL_FORMAT,
    FileLock,
    complete_publish,
    finish_interrupted_publish,
    journal_path,
    lock_path,
    publish_files,
)

__all__ = [
    "JOURNAL_FORMAT", "FileLock", "HashingWriter", "atomic_dir", "atomic_open", "check_writable_dir",
    "complete_publish", "exchange_paths", "file_blake2b", "finish_interrupted_publish", "foreign_entries",
    "fsync_dir", "fsync_tree", "journal_path", "lock_path", "missing_file", "os_error_text", "publish_files",
    "read_json_object", "replace_dir", "stale_temps", "temp_path", "write_json_atomic",
]
