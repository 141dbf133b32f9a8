#!/usr/bin/env bash
# Sourced by liger_wheel.sh and torchao_wheel.sh. A device call carries at most 64 MiB, and the DSL
# pack (63.6 MB with apache-tvm-ffi) and the working tree (2.4 MB) leave about 1 MB: the baselines'
# pure-Python packages travel as one solid xz archive of their installed files (Liger 0.8.5: 0.41 MB,
# against 0.79 MB as a zip wheel, which compresses each file alone). gpu_session.sh's set-up unpacks
# every .wheels*/*.tar.xz into /tmp/coda-wheels, which it puts on PYTHONPATH.

# archive_site DIR OUT: DIR's contents as the xz archive OUT
archive_site() {
    tar cf - -C "$1" . | xz -9e > "$2"
}

# carry_report FOLDER...: the bytes a call carrying the working tree, .dsl and FOLDERs takes
carry_report() {
    local tree rest
    tree=$({ git ls-files; git ls-files -o --exclude-standard; } | xargs -d '\n' stat -c %s | awk '{s += $1} END {print s}')
    rest=$(find .dsl "$@" -type f -printf '%s\n' 2>/dev/null | awk '{s += $1} END {print s}')
    echo "carry with .dsl and $*: $(((tree + rest) / 1024)) KiB of 65536 KiB (about 65,283 KiB ran, 65,405 was refused)"
}
