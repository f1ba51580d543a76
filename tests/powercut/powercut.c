/* The power-loss layer's recorder: an LD_PRELOAD library that notes, in a journal, what a
 * process has made durable under one directory, so that a test can cut the power after
 * killing it (tests/powercut/__init__.py undoes everything else).
 *
 * The model is ext4's with its default data=ordered journal:
 *   - a file's data is durable up to the size it had at its last fsync or fdatasync;
 *   - metadata (a file created, renamed or unlinked) is durable once any fsync or fdatasync
 *     under the directory follows it, since that commits the filesystem's journal.
 * Writes themselves pass through untouched: the page cache keeps them until the cut.
 *
 * Environment: POWERCUT_DIR (an absolute directory: only paths under it are watched),
 * POWERCUT_JOURNAL (the journal, appended to), POWERCUT_GRAVE (a directory on the same
 * filesystem where a replaced or unlinked file is kept as a hard link, so a cut can bring
 * its name back). Without POWERCUT_DIR every call only passes through.
 * POWERCUT_SLOW_SYNC="SUFFIX:MS" (optional) makes every fsync or fdatasync of a watched file
 * whose name ends in SUFFIX take MS milliseconds more, as a slow disk would: a test widens the
 * windows in which a process waits on such a sync (LevelDB's table files, ".ldb") and cuts the
 * power inside them.
 *
 * Journal lines, fields separated by tabs (one write each, O_APPEND):
 *   sync INO SIZE             a file synced at SIZE bytes (or a directory: SIZE -1)
 *   create INO PATH           PATH made by this open
 *   rename INO OLD NEW TGT    INO renamed from OLD to NEW, replacing inode TGT (0: none)
 *   unlink INO PATH           PATH unlinked
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static char watch[PATH_MAX];
static size_t watch_len;
static char grave[PATH_MAX];
static int journal = -1;
static char slow_suffix[64];
static size_t slow_suffix_len;
static long slow_ms;

__attribute__((constructor)) static void powercut_init(void) {
    const char *dir = getenv("POWERCUT_DIR");
    const char *path = getenv("POWERCUT_JOURNAL");
    const char *keep = getenv("POWERCUT_GRAVE");
    if (dir == NULL || path == NULL || keep == NULL) return;
    snprintf(watch, sizeof watch, "%s", dir);
    watch_len = strlen(watch);
    while (watch_len > 1 && watch[watch_len - 1] == '/') watch[--watch_len] = '\0';
    snprintf(grave, sizeof grave, "%s", keep);
    const char *slow = getenv("POWERCUT_SLOW_SYNC");
    const char *colon = slow == NULL ? NULL : strrchr(slow, ':');
    if (colon != NULL && (size_t)(colon - slow) < sizeof slow_suffix) {
        memcpy(slow_suffix, slow, (size_t)(colon - slow));
        slow_suffix_len = (size_t)(colon - slow);
        slow_ms = strtol(colon + 1, NULL, 10);
    }
    int (*real_open)(const char *, int, ...) = dlsym(RTLD_NEXT, "open");
    journal = real_open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
}

static void note(const char *format, ...) {
    char line[3 * PATH_MAX + 128];
    va_list args;
    va_start(args, format);
    int n = vsnprintf(line, sizeof line, format, args);
    va_end(args);
    if (n > 0 && (size_t)n < sizeof line) {
        int saved = errno;
        ssize_t ignored = write(journal, line, (size_t)n);
        (void)ignored;
        errno = saved;
    }
}

/* `path` (relative to `dirfd`, or to the working directory) made absolute into `out`. */
static int absolute(int dirfd, const char *path, char *out) {
    if (path[0] == '/') {
        snprintf(out, PATH_MAX, "%s", path);
        return 0;
    }
    char base[PATH_MAX];
    if (dirfd == AT_FDCWD) {
        if (getcwd(base, sizeof base) == NULL) return -1;
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof base - 1);
        if (n < 0) return -1;
        base[n] = '\0';
    }
    snprintf(out, PATH_MAX, "%s/%s", base, path);
    return 0;
}

static int under_watch(const char *path) {
    return journal >= 0 && strncmp(path, watch, watch_len) == 0 &&
           (path[watch_len] == '/' || path[watch_len] == '\0');
}

static void keep_in_grave(const char *path, ino_t ino) {
    char kept[PATH_MAX];
    snprintf(kept, sizeof kept, "%s/%lu", grave, (unsigned long)ino);
    int saved = errno;
    link(path, kept); /* EEXIST: kept already */
    errno = saved;
}

/* The path of `fd` into `path` if it is under the watched directory: its length, or -1. */
static ssize_t watched_path(int fd, char *path) {
    if (journal < 0) return -1;
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, PATH_MAX - 1);
    if (n < 0) return -1;
    path[n] = '\0';
    return under_watch(path) ? n : -1;
}

static void note_sync(int fd) {
    char path[PATH_MAX];
    struct stat st;
    if (watched_path(fd, path) < 0 || fstat(fd, &st) != 0) return;
    note("sync\t%lu\t%lld\n", (unsigned long)st.st_ino,
         S_ISDIR(st.st_mode) ? -1LL : (long long)st.st_size);
}

/* POWERCUT_SLOW_SYNC: a sync of a watched file with the suffix waits first. */
static void slow_down(int fd) {
    if (slow_ms <= 0) return;
    char path[PATH_MAX];
    ssize_t n = watched_path(fd, path);
    if (n < (ssize_t)slow_suffix_len || strcmp(path + n - slow_suffix_len, slow_suffix) != 0)
        return;
    int saved = errno;
    struct timespec pause = {slow_ms / 1000, (slow_ms % 1000) * 1000000L};
    while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
    }
    errno = saved;
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = dlsym(RTLD_NEXT, "fsync");
    slow_down(fd);
    int r = real(fd);
    if (r == 0) note_sync(fd);
    return r;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = dlsym(RTLD_NEXT, "fdatasync");
    slow_down(fd);
    int r = real(fd);
    if (r == 0) note_sync(fd);
    return r;
}

/* An open that may create: note the file if it did not exist before. */
static int opened(int dirfd, const char *path, int flags, int fd, int existed) {
    if (fd < 0 || !(flags & O_CREAT) || existed || journal < 0) return fd;
    char full[PATH_MAX];
    struct stat st;
    if (absolute(dirfd, path, full) == 0 && under_watch(full) && fstat(fd, &st) == 0)
        note("create\t%lu\t%s\n", (unsigned long)st.st_ino, full);
    return fd;
}

static int exists_at(int dirfd, const char *path) {
    int saved = errno;
    int r = faccessat(dirfd, path, F_OK, 0) == 0;
    errno = saved;
    return r;
}

/* The mode argument of an open that may create (va_start needs the last named argument). */
#define MODE_OF(flags, mode)                    \
    mode_t mode = 0;                            \
    if ((flags) & (O_CREAT | O_TMPFILE)) {      \
        va_list args;                           \
        va_start(args, flags);                  \
        mode = va_arg(args, mode_t);            \
        va_end(args);                           \
    }

#define OPENAT_LIKE(name)                                                           \
    int name(int dirfd, const char *path, int flags, ...) {                         \
        static int (*real)(int, const char *, int, ...);                            \
        if (real == NULL) real = dlsym(RTLD_NEXT, #name);                           \
        MODE_OF(flags, mode)                                                        \
        int existed = (flags & O_CREAT) ? exists_at(dirfd, path) : 1;               \
        return opened(dirfd, path, flags, real(dirfd, path, flags, mode), existed); \
    }
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)

int open(const char *path, int flags, ...) {
    MODE_OF(flags, mode)
    return openat(AT_FDCWD, path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    MODE_OF(flags, mode)
    return openat64(AT_FDCWD, path, flags, mode);
}

int creat(const char *path, mode_t mode) { return open(path, O_CREAT | O_WRONLY | O_TRUNC, mode); }
int creat64(const char *path, mode_t mode) { return open(path, O_CREAT | O_WRONLY | O_TRUNC, mode); }

FILE *fopen(const char *path, const char *how) {
    static FILE *(*real)(const char *, const char *);
    if (real == NULL) real = dlsym(RTLD_NEXT, "fopen");
    int creates = how[0] == 'w' || how[0] == 'a';
    int existed = creates ? exists_at(AT_FDCWD, path) : 1;
    FILE *f = real(path, how);
    if (f != NULL && creates) opened(AT_FDCWD, path, O_CREAT, fileno(f), existed);
    return f;
}

FILE *fopen64(const char *path, const char *how) { return fopen(path, how); }

static int renamed(int olddir, const char *old, int newdir, const char *new,
                   int (*call)(int, const char *, int, const char *, unsigned int),
                   unsigned int flags) {
    char from[PATH_MAX], to[PATH_MAX];
    struct stat source, target;
    int watched = journal >= 0 && absolute(olddir, old, from) == 0 &&
                  absolute(newdir, new, to) == 0 && (under_watch(from) || under_watch(to)) &&
                  fstatat(olddir, old, &source, AT_SYMLINK_NOFOLLOW) == 0;
    unsigned long replaced = 0;
    if (watched && fstatat(newdir, new, &target, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(target.st_mode)) {
        keep_in_grave(to, target.st_ino);
        replaced = (unsigned long)target.st_ino;
    }
    int r = call(olddir, old, newdir, new, flags);
    if (r == 0 && watched)
        note("rename\t%lu\t%s\t%s\t%lu\n", (unsigned long)source.st_ino, from, to, replaced);
    return r;
}

static int (*real_renameat2)(int, const char *, int, const char *, unsigned int);

static int call_renameat2(int a, const char *b, int c, const char *d, unsigned int flags) {
    if (real_renameat2 == NULL) real_renameat2 = dlsym(RTLD_NEXT, "renameat2");
    return real_renameat2(a, b, c, d, flags);
}

int rename(const char *old, const char *new) {
    return renamed(AT_FDCWD, old, AT_FDCWD, new, call_renameat2, 0);
}

int renameat(int olddir, const char *old, int newdir, const char *new) {
    return renamed(olddir, old, newdir, new, call_renameat2, 0);
}

int renameat2(int olddir, const char *old, int newdir, const char *new, unsigned int flags) {
    return renamed(olddir, old, newdir, new, call_renameat2, flags);
}

static int unlinked(int dirfd, const char *path, int flags) {
    static int (*real)(int, const char *, int);
    if (real == NULL) real = dlsym(RTLD_NEXT, "unlinkat");
    char full[PATH_MAX];
    struct stat st;
    int watched = journal >= 0 && !(flags & AT_REMOVEDIR) &&
                  absolute(dirfd, path, full) == 0 && under_watch(full) &&
                  fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
    if (watched) keep_in_grave(full, st.st_ino);
    int r = real(dirfd, path, flags);
    if (r == 0 && watched) note("unlink\t%lu\t%s\n", (unsigned long)st.st_ino, full);
    return r;
}

int unlink(const char *path) { return unlinked(AT_FDCWD, path, 0); }

int unlinkat(int dirfd, const char *path, int flags) { return unlinked(dirfd, path, flags); }
