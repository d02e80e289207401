#!/usr/bin/env bash
# Rewrites the fuzz targets' seed corpus, fuzz/corpus/, from the library as it now is (run it
# after any change to the wire format or the engine protocol, and commit the result). The
# generator, fuzz/make_corpus.cpp, checks that the receivers of fuzz_payload and fuzz_envelope
# accept everything it writes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$("$root/scripts/build.sh" fuzz)
cmake --build "$dir" --target fuzz_corpus
