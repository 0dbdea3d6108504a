#!/bin/sh
# Unpacks Debian's non-free NVIDIA user-space driver (libcuda1, libnvidia-ml1, nvidia-smi)
# into DEST for the real-driver test tier, without installing anything: apt runs on a
# private copy of the system's sources (with the non-free components added) and private
# lists and cache under DEST, and the packages are only downloaded and unpacked. So the
# machine keeps having no NVIDIA driver for everything else, and no root is needed.
#
# DEST/lib then holds libcuda.so.1 and libnvidia-ml.so.1, DEST/bin nvidia-smi and
# DEST/version the packages' version. Where that cannot be done, DEST/unavailable says why
# and the script still succeeds: the tier is skipped with that reason, and the next run
# tries again.
set -u
DEST=$1
PKGS="libcuda1 libnvidia-ml1 nvidia-smi"

unavailable() {
	mkdir -p "$DEST"
	printf '%s\n' "$*" >"$DEST/unavailable"
	echo "make: real NVIDIA driver tier unavailable: $*" >&2
	exit 0
}

[ -e "$DEST/version" ] && exit 0
rm -rf "$DEST"
command -v apt-get >/dev/null || unavailable "apt-get not found (not a Debian system)"
command -v dpkg-deb >/dev/null || unavailable "dpkg-deb not found (not a Debian system)"

work="$DEST/apt"
mkdir -p "$work/parts" "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
# The system's own sources, so its mirror and proxy settings apply, each Debian entry
# with the components that hold the driver.
for f in /etc/apt/sources.list.d/*.sources; do
	[ -e "$f" ] || continue
	sed 's/^Components:.*/Components: main contrib non-free non-free-firmware/' "$f" \
		>"$work/parts/$(basename "$f")"
done
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
	[ -e "$f" ] || continue
	sed -E 's/^(deb[[:space:]].*[[:space:]]main)([[:space:]].*)?$/\1 contrib non-free non-free-firmware/' \
		"$f" >"$work/parts/$(basename "$f").list"
done
work_abs=$(cd "$work" && pwd)
cat >"$work/apt.conf" <<EOF
Dir::Etc::SourceList "/dev/null";
Dir::Etc::SourceParts "$work_abs/parts";
Dir::State::Lists "$work_abs/lists";
Dir::State::status "/dev/null";
Dir::Cache "$work_abs/cache";
Debug::NoLocking "true";
APT::Sandbox::User "$(id -un)";
Acquire::Retries "1";
Acquire::http::Timeout "30";
EOF
export APT_CONFIG="$work_abs/apt.conf"
apt-get -qq --error-on=any update >"$work/update.log" 2>&1 ||
	unavailable "apt-get update failed (no network or no Debian mirror?): $(grep -m 1 -E "^(W|E):" "$work/update.log")"
(cd "$work/debs" && apt-get -qq download $PKGS) >"$work/download.log" 2>&1 ||
	unavailable "apt-get download $PKGS failed: $(tail -n 1 "$work/download.log")"
mkdir -p "$work/root" "$DEST/lib" "$DEST/bin"
for deb in "$work"/debs/*.deb; do
	dpkg-deb -x "$deb" "$work/root" || unavailable "dpkg-deb -x $deb failed"
done
# The packages put the libraries in Debian's alternatives folder for the driver.
for lib in libcuda.so.1 libnvidia-ml.so.1; do
	found=$(find "$work/root" -name "$lib" | head -n 1)
	[ -n "$found" ] || unavailable "the packages hold no $lib"
	cp -P "$(dirname "$found")"/"${lib%.1}".* "$DEST/lib/"
done
smi=$(find "$work/root" -path "*/lib/nvidia/*" -type f -name nvidia-smi | head -n 1)
[ -n "$smi" ] || unavailable "the nvidia-smi package holds no nvidia-smi"
cp "$smi" "$DEST/bin/nvidia-smi"
dpkg-deb -f "$work"/debs/libcuda1_*.deb Version >"$DEST/version.new"
rm -rf "$work"
mv "$DEST/version.new" "$DEST/version"
echo "make: real NVIDIA driver $(cat "$DEST/version") unpacked in $DEST" >&2
