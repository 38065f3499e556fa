/* faultshim.c - LD_PRELOAD syscall-boundary fault injector for file I/O.
 *
 * Env vars (read once, at first intercepted call):
 *   FAULT_PATH   fnmatch(3) glob matched against readlink(/proc/self/fd/N);
 *                '*' also matches '/'. Unset => shim is inert.
 *   FAULT_OPS    comma list of op classes to fault: read,write,fsync  (default "read,write")
 *                read  = read pread pread64 readv preadv preadv64 preadv2 preadv64v2
 *                write = write pwrite pwrite64 writev pwritev pwritev64 pwritev2 pwritev64v2
 *                fsync = fsync fdatasync
 *   FAULT_ERRNO  errno number to return (default 5 = EIO; 28 = ENOSPC, 30 = EROFS)
 *   FAULT_AFTER  let the first N matching calls succeed (default 0)
 *   FAULT_COUNT  fail only this many calls, then succeed again (default 0 = forever)
 *   FAULT_SHORT  if "1": instead of an error, writes/reads do HALF the bytes and
 *                return a short count (single-buffer calls only; vector calls error)
 *   FAULT_CTL    path of a control file; faults are active only while it exists
 *                (lets a test switch faults on/off in a running process)
 *   FAULT_LOG    if "1": log every injected fault to stderr
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { OP_READ = 1, OP_WRITE = 2, OP_FSYNC = 4 };

static int g_init, g_ops = OP_READ | OP_WRITE, g_errno = EIO, g_short, g_log;
static const char *g_path, *g_ctl;
static long g_after, g_count;
static long g_seen, g_failed; /* atomics */

static void init(void) {
    if (__atomic_load_n(&g_init, __ATOMIC_ACQUIRE)) return;
    const char *s;
    g_path = getenv("FAULT_PATH");
    g_ctl = getenv("FAULT_CTL");
    if ((s = getenv("FAULT_OPS"))) {
        g_ops = 0;
        if (strstr(s, "read")) g_ops |= OP_READ;
        if (strstr(s, "write")) g_ops |= OP_WRITE;
        if (strstr(s, "fsync")) g_ops |= OP_FSYNC;
    }
    if ((s = getenv("FAULT_ERRNO"))) g_errno = atoi(s);
    if ((s = getenv("FAULT_AFTER"))) g_after = atol(s);
    if ((s = getenv("FAULT_COUNT"))) g_count = atol(s);
    if ((s = getenv("FAULT_SHORT"))) g_short = (*s == '1');
    if ((s = getenv("FAULT_LOG"))) g_log = (*s == '1');
    __atomic_store_n(&g_init, 1, __ATOMIC_RELEASE);
}

/* returns 1 if this call should be faulted */
static int should_fault(int fd, int op, const char *fn) {
    init();
    if (!g_path || !(g_ops & op)) return 0;
    char link[64], target[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = 0;
    if (fnmatch(g_path, target, 0) != 0) return 0;
    if (g_ctl) { struct stat st; if (stat(g_ctl, &st) != 0) return 0; }
    long seen = __atomic_fetch_add(&g_seen, 1, __ATOMIC_RELAXED);
    if (seen < g_after) return 0;
    if (g_count > 0 && __atomic_fetch_add(&g_failed, 1, __ATOMIC_RELAXED) >= g_count) return 0;
    if (g_log) fprintf(stderr, "faultshim: %s(fd=%d %s) -> %s\n", fn, fd, target,
                       g_short ? "short" : strerror(g_errno));
    return 1;
}

#define REAL(name, ret, ...) \
    static ret (*real_##name)(__VA_ARGS__); \
    if (!real_##name) real_##name = (ret (*)(__VA_ARGS__))dlsym(RTLD_NEXT, #name)

#define SHORTLEN(c) ((c) > 1 ? (c) / 2 : (c))

/* ---- single-buffer calls ---- */

ssize_t read(int fd, void *b, size_t c) {
    REAL(read, ssize_t, int, void *, size_t);
    if (should_fault(fd, OP_READ, "read")) { if (!g_short) { errno = g_errno; return -1; } c = SHORTLEN(c); }
    return real_read(fd, b, c);
}
ssize_t write(int fd, const void *b, size_t c) {
    REAL(write, ssize_t, int, const void *, size_t);
    if (should_fault(fd, OP_WRITE, "write")) { if (!g_short) { errno = g_errno; return -1; } c = SHORTLEN(c); }
    return real_write(fd, b, c);
}
#define PREAD_IMPL(name) \
ssize_t name(int fd, void *b, size_t c, off_t o) { \
    REAL(name, ssize_t, int, void *, size_t, off_t); \
    if (should_fault(fd, OP_READ, #name)) { if (!g_short) { errno = g_errno; return -1; } c = SHORTLEN(c); } \
    return real_##name(fd, b, c, o); }
#define PWRITE_IMPL(name) \
ssize_t name(int fd, const void *b, size_t c, off_t o) { \
    REAL(name, ssize_t, int, const void *, size_t, off_t); \
    if (should_fault(fd, OP_WRITE, #name)) { if (!g_short) { errno = g_errno; return -1; } c = SHORTLEN(c); } \
    return real_##name(fd, b, c, o); }
PREAD_IMPL(pread)
PREAD_IMPL(pread64)
PWRITE_IMPL(pwrite)
PWRITE_IMPL(pwrite64)

/* ---- vector calls (error only) ---- */
#define VEC_IMPL(name, op, params, types, args, fdarg) \
ssize_t name params { \
    REAL(name, ssize_t, types); \
    if (should_fault(fdarg, op, #name)) { errno = g_errno; return -1; } \
    return real_##name args; }
#define P3 (int fd, const struct iovec *v, int n)
#define T3 int, const struct iovec *, int
#define P4 (int fd, const struct iovec *v, int n, off_t o)
#define T4 int, const struct iovec *, int, off_t
#define P5 (int fd, const struct iovec *v, int n, off_t o, int f)
#define T5 int, const struct iovec *, int, off_t, int
VEC_IMPL(readv,       OP_READ,  P3, T3, (fd, v, n), fd)
VEC_IMPL(writev,      OP_WRITE, P3, T3, (fd, v, n), fd)
VEC_IMPL(preadv,      OP_READ,  P4, T4, (fd, v, n, o), fd)
VEC_IMPL(preadv64,    OP_READ,  P4, T4, (fd, v, n, o), fd)
VEC_IMPL(pwritev,     OP_WRITE, P4, T4, (fd, v, n, o), fd)
VEC_IMPL(pwritev64,   OP_WRITE, P4, T4, (fd, v, n, o), fd)
VEC_IMPL(preadv2,     OP_READ,  P5, T5, (fd, v, n, o, f), fd)
VEC_IMPL(preadv64v2,  OP_READ,  P5, T5, (fd, v, n, o, f), fd)
VEC_IMPL(pwritev2,    OP_WRITE, P5, T5, (fd, v, n, o, f), fd)
VEC_IMPL(pwritev64v2, OP_WRITE, P5, T5, (fd, v, n, o, f), fd)

/* ---- durability calls ---- */
int fsync(int fd) {
    REAL(fsync, int, int);
    if (should_fault(fd, OP_FSYNC, "fsync")) { errno = g_errno; return -1; }
    return real_fsync(fd);
}
int fdatasync(int fd) {
    REAL(fdatasync, int, int);
    if (should_fault(fd, OP_FSYNC, "fdatasync")) { errno = g_errno; return -1; }
    return real_fdatasync(fd);
}
