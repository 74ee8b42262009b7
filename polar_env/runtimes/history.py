"""Drop a task repo's history past its base, so an agent cannot read the fix out of ``.git``.

SWE images keep the workdir (``/testbed``) as a full clone reset to ``base_commit``: the commits
that fixed the task stay reachable through remote-tracking refs, tags, other branches, reflogs, the
stash, ``packed-refs``, ``FETCH_HEAD``/``ORIG_HEAD``, ``objects/info/alternates`` and dangling
objects in the object store. ``SCRUB_HISTORY`` (POSIX sh and git only: it runs inside the image, in
the workdir, before the agent's first command) rebuilds ``.git`` so that it holds exactly HEAD's
commit and the trees and blobs of its tree — nothing else:

- the objects: ``rev-list --objects --no-walk HEAD | pack-objects`` into a fresh ``git init``'ed
  dir, one pack; ``shallow`` names HEAD's commit, so its parents are absent by design (``git log``
  shows one commit, ``HEAD~1`` does not resolve). The commit id is unchanged (same object).
- the refs: HEAD only — on the branch it named (that branch at HEAD's commit) or detached.
- kept: the index (re-read with ``git reset -q``, so ``git status`` stays as it was), ``core.*``
  config but the keys that point outside (worktree, hooksPath, fsmonitor, sshCommand, alternate
  refs) and ``info/{exclude,attributes,sparse-checkout}``.
- gone: every other ref (branches, tags, remotes, notes, stash, replace), remotes and every non-core
  config, hooks, reflogs, packed-refs, FETCH_HEAD/ORIG_HEAD, alternates, grafts, the old
  ``shallow``, worktrees, ``modules`` (a checked-out submodule's ``.git`` link into it is removed, so
  its files stay as plain files) and every other object.
Then the old ``.git``'s entries are removed and the new ones moved into it (the directory itself
stays: on overlayfs, renaming a lower-layer directory would copy it).

No-op (exit 0) when there is no ``.git``, when ``.git`` is a file (a gitdir link: the store lives
elsewhere, shared with other worktrees, and is not the workdir's to rewrite) or a symlink, and when
HEAD is unborn. Not touched: object stores outside ``.git`` that an alternates file named (only the
link is gone). A failure before the swap leaves ``.git`` as it was and exits 1 with the reason (the
runtime logs it); the grader's fresh runtime runs it too, and keeps working because the grading
reset (``git checkout <base_commit> -- files``) needs only HEAD's commit, which stays — provided
the image's HEAD is ``base_commit``, as in SWE-bench and SWE-Gym images.
"""

from __future__ import annotations

SCRUB_HISTORY = r"""(
g() { git -c safe.directory='*' -c core.hooksPath=/dev/null -c core.fsmonitor= -c gc.auto=0 "$@"; }
new=.git/polar-scrub
n() { g --git-dir="$new" "$@"; }
fail() { echo "polar: the repository's history is not dropped: $1" >&2; rm -rf "$new"; exit 1; }
if [ -L .git ] || [ ! -d .git ]; then exit 0; fi
command -v git >/dev/null 2>&1 || fail "no git in the image"
if ! head=$(g rev-parse -q --verify 'HEAD^{commit}'); then
  g symbolic-ref -q HEAD >/dev/null && exit 0
  fail "HEAD names no commit"
fi
ref=$(g symbolic-ref -q HEAD) || ref=
fmt=$(g rev-parse --show-object-format 2>/dev/null) || fmt=sha1
rm -rf "$new" || fail "cannot clear $new"
if [ "$fmt" = sha1 ]; then set -- ; else set -- "--object-format=$fmt"; fi
g -c init.defaultBranch=polar-scrub init -q --bare --template= "$@" "$new" >/dev/null || fail "git init"
g rev-list --objects --no-walk "$head" >"$new/polar-objects" || fail "cannot list HEAD's objects"
g pack-objects -q --window=0 "$new/objects/pack/pack" <"$new/polar-objects" >/dev/null || fail "cannot pack HEAD's objects"
rm -f "$new/polar-objects" && echo "$head" >"$new/shallow" || fail "cannot write $new/shallow"
if [ -n "$ref" ]; then n update-ref "$ref" "$head" && n symbolic-ref HEAD "$ref"
else n update-ref --no-deref HEAD "$head"; fi || fail "cannot point HEAD at $head"
n config core.bare false && n config core.logAllRefUpdates true || fail "cannot write the config"
g config --file .git/config --get-regexp '^core\.' 2>/dev/null | while read -r key value; do
  case $key in
    core.bare|core.worktree|core.repositoryformatversion|core.hookspath|core.fsmonitor) continue ;;
    core.sshcommand|core.alternaterefscommand|core.alternaterefsprefixes) continue ;;
  esac
  n config "$key" "${value:-true}" || exit 1
done || fail "cannot copy the core config"
mkdir -p "$new/info" || fail "cannot create $new/info"
for f in info/exclude info/attributes info/sparse-checkout index .git/sharedindex.*; do
  f=${f#.git/}
  if [ -f ".git/$f" ]; then cp ".git/$f" "$new/$f" || fail "cannot copy .git/$f"; fi
done
[ "$(n rev-parse -q --verify 'HEAD^{commit}')" = "$head" ] && n cat-file -e "$head^{tree}" || fail "the new store lacks HEAD"
modules=; if [ -d .git/modules ]; then modules=1; fi
for f in .git/* .git/.[!.]* .git/..?*; do
  if [ "$f" != "$new" ] && { [ -e "$f" ] || [ -L "$f" ]; }; then
    rm -rf "$f" || { echo "polar: cannot remove $f: the repository is broken" >&2; exit 1; }
  fi
done
for f in "$new"/*; do mv "$f" .git/ || { echo "polar: cannot move $f into .git" >&2; exit 1; }; done
rmdir "$new" || exit 1
if [ -n "$modules" ]; then
  g ls-files -s | while read -r mode _oid _stage path; do
    if [ "$mode" = 160000 ] && [ -f "$path/.git" ]; then rm -f "$path/.git"; fi
  done
fi
g reset -q 2>/dev/null || { rm -f .git/index && g reset -q; } || { echo "polar: git reset failed after the scrub" >&2; exit 1; }
g update-index -q --refresh >/dev/null 2>&1 || :
rm -rf .git/ORIG_HEAD .git/logs  # written by the reset: HEAD only, but no reflog is promised
)"""
