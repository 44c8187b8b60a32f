#!/usr/bin/env bash
# Builds the chat client into client_cs/bin/.
#   - With the .NET SDK (`dotnet` on PATH): `dotnet build` of chat.csproj, giving
#     bin/chat.dll and the native launcher bin/chat. Run: dotnet client_cs/bin/chat.dll
#   - Otherwise with Mono's `mcs` (Debian's mono-devel is installed with apt-get when mcs
#     is missing), giving bin/chat.exe. Run: mono client_cs/bin/chat.exe
# Set CHAT_BUILD_WITH=mcs or CHAT_BUILD_WITH=dotnet to choose the toolchain yourself.
# Idempotent: when no source is newer than the last build with the same toolchain,
# nothing is rebuilt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/bin"
sources=("$here"/*.cs)
inputs=("${sources[@]}" "$here/chat.csproj" "$here/build.sh")

tool="${CHAT_BUILD_WITH:-}"
if [ -z "$tool" ]; then
    if command -v dotnet >/dev/null 2>&1; then tool=dotnet; else tool=mcs; fi
fi
case "$tool" in
    dotnet) target="$out/chat.dll" ;;
    mcs) target="$out/chat.exe" ;;
    *) echo "client_cs: CHAT_BUILD_WITH must be dotnet or mcs, not '$tool'" >&2; exit 2 ;;
esac
stamp="$out/.built-with-$tool" # touched after a successful build

up_to_date() {
    [ -f "$target" ] && [ -f "$stamp" ] || return 1
    local f
    for f in "${inputs[@]}"; do
        [ "$f" -nt "$stamp" ] && return 1
    done
    return 0
}

if up_to_date; then
    echo "client_cs: $target is up to date"
    exit 0
fi

mkdir -p "$out"
rm -f "$stamp"
if [ "$tool" = dotnet ]; then
    dotnet build "$here/chat.csproj" -c Release -o "$out" --nologo -v quiet
else
    if ! command -v mcs >/dev/null 2>&1; then
        echo "client_cs: mcs not found; installing mono-devel with apt-get" >&2
        sudo=""
        if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
        export DEBIAN_FRONTEND=noninteractive
        $sudo apt-get update -qq
        $sudo apt-get install -y -qq mono-devel >/dev/null
    fi
    # Compile to a temporary name and rename, so a failed build never leaves a
    # half-written chat.exe behind.
    mcs -langversion:7 -nologo -optimize+ -target:exe -out:"$target.tmp" \
        -r:System.Net.Http -r:System.Runtime.Serialization \
        "${sources[@]}"
    mv -f "$target.tmp" "$target"
fi
touch "$stamp"
echo "client_cs: built $target with $tool"
