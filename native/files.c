/*
 * --read-file and --write-file (version 9): a file moved as the user this process runs as, with the
 * kernel's own permission checks, for a backend whose fast channel cannot take the user's permissions
 * (Docker's archive API reads and writes as root). The same rules as the host's read_file and
 * write_file (dsh_bash/host/_files.py), which the contract's R-file-* clauses state:
 *
 *   dsh-supervise --read-file PATH --max-bytes N
 *       the file's bytes on stdout. Opened non-blocking (a FIFO nobody writes never blocks the
 *       open), then refused unless a regular file of at most N bytes; a file that grows past N while
 *       it is read is refused too (what was written to stdout is then to be dropped).
 *   dsh-supervise --write-file PATH --temp-name NAME --size N [--make-parents]
 *       N bytes from stdin written into NAME, a fresh file beside PATH (O_EXCL, never through a link),
 *       renamed over PATH once whole: a reader never sees it half written. Fewer than N bytes (the
 *       harness went away mid-write) or more: nothing is renamed, the fresh file is removed. An
 *       existing file keeps its mode; one the user may not write stays unwritten; one of another
 *       owner, or one in a directory the user may not write, is rewritten in place (not atomic).
 *
 * Exit status: 0; a refusal (nothing read or written) is one of the FILE_* codes below with one line on
 * stderr; 1 for any other failure (a message on stderr); 125 for usage errors.
 */
#include "common.h"
#include "files.h"

#define FILE_NOT_FOUND 80
#define FILE_IS_A_DIRECTORY 81
#define FILE_NOT_REGULAR 82
#define FILE_PERMISSION_DENIED 83
#define FILE_TOO_LARGE 84
#define FILE_NO_SPACE 85

static void refuse(int code, const char *doing, const char *path, const char *why) __attribute__((noreturn));
static void refuse(int code, const char *doing, const char *path, const char *why)
{
    fprintf(stderr, "cannot %s %s: %s\n", doing, path, why);
    exit(code);
}

static void refuse_errno(int err, const char *doing, const char *path) __attribute__((noreturn));
static void refuse_errno(int err, const char *doing, const char *path)
{
    int code = 1;
    switch (err) {
    case ENOENT:
    case ENOTDIR:
    case ELOOP:
        code = FILE_NOT_FOUND;
        break;
    case EACCES:
    case EPERM:
    case EROFS:
        code = FILE_PERMISSION_DENIED;
        break;
    case EISDIR:
        code = FILE_IS_A_DIRECTORY;
        break;
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
        code = FILE_NO_SPACE;
        break;
    case ENXIO:
        code = FILE_NOT_REGULAR;
        break;
    }
    refuse(code, doing, path, strerror(err));
}

static void check_kind(mode_t mode, const char *doing, const char *path)
{
    if (S_ISDIR(mode))
        refuse(FILE_IS_A_DIRECTORY, doing, path, "Is a directory");
    if (!S_ISREG(mode))
        refuse(FILE_NOT_REGULAR, doing, path, "not a regular file (a device, FIFO or socket)");
}

/* 0, or the errno of the write that failed. */
static int write_all(int fd, const char *buf, size_t n)
{
    return write_exact(fd, buf, n) == 0 ? 0 : errno;
}

static long long parse_count(const char *s, const char *opt)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < 0)
        die("%s wants a number of bytes, not '%s'", opt, s);
    return v;
}

/* PATH opened with FLAGS (non-blocking among them: a FIFO never blocks the open), refused unless a
 * regular file; its stat in *ST. */
static int open_regular(const char *path, int flags, const char *doing, struct stat *st)
{
    int fd = open(path, flags | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0 || fstat(fd, st) < 0)
        refuse_errno(errno, doing, path);
    check_kind(st->st_mode, doing, path);
    return fd;
}

static int read_file(const char *path, long long max_bytes)
{
    struct stat st;
    int fd = open_regular(path, O_RDONLY, "read", &st);
    if (st.st_size > max_bytes)
        refuse(FILE_TOO_LARGE, "read", path, "larger than max_file_bytes");
    static char buf[READ_SIZE];
    long long taken = 0;
    for (;;) {
        long long room = max_bytes + 1 - taken;
        ssize_t n = read(fd, buf, room < (long long)sizeof buf ? (size_t)room : sizeof buf);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            refuse_errno(errno, "read", path);
        }
        if (n == 0)
            return 0;
        taken += n;
        if (taken > max_bytes)
            refuse(FILE_TOO_LARGE, "read", path, "grew past max_file_bytes while it was read");
        int err = write_all(1, buf, (size_t)n);
        if (err != 0) {
            fprintf(stderr, "cannot pass %s on: %s\n", path, strerror(err));
            return 1;
        }
    }
}

/* Exactly SIZE bytes of stdin into FD; 0, or the errno of a failed write, or -1 for a stdin that ended
 * early or went on past SIZE (then *SHORT says how many came). */
static int copy_stdin(int fd, long long size, long long *came)
{
    static char buf[READ_SIZE];
    *came = 0;
    for (;;) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0)
            return *came == size ? 0 : -1;
        *came += n;
        if (*came > size)
            return -1;
        int err = write_all(fd, buf, (size_t)n);
        if (err != 0)
            return err;
    }
}

static void write_failed(int err, long long came, long long size, const char *path, const char *temp)
{
    if (temp != NULL)
        unlink(temp);
    if (err == -1) {
        fprintf(stderr, "cannot write %s: %lld bytes came of %lld; nothing was put in place\n", path, came, size);
        exit(1);
    }
    refuse_errno(err, "write", path);
}

static int write_in_place(const char *path, long long size)
{
    struct stat st;
    int fd = open_regular(path, O_WRONLY | O_TRUNC | O_NOFOLLOW, "write", &st);
    long long came;
    int err = copy_stdin(fd, size, &came);
    if (err == 0 && close(fd) < 0)
        err = errno;
    if (err != 0)
        write_failed(err, came, size, path, NULL);
    return 0;
}

static void make_parents(char *directory)
{
    for (char *slash = strchr(directory + 1, '/');; slash = strchr(slash + 1, '/')) {
        if (slash != NULL)
            *slash = '\0';
        if (mkdir(directory, 0777) < 0 && errno != EEXIST)
            refuse_errno(errno, "make the directory", directory);
        if (slash == NULL)
            return;
        *slash = '/';
    }
}

static int write_file(const char *path, const char *temp_name, long long size, int parents)
{
    const char *last = strrchr(path, '/');
    if (path[0] != '/' || last == NULL || last[1] == '\0' || strchr(temp_name, '/') != NULL)
        die("--write-file wants an absolute PATH naming a file, --temp-name a name without '/'");
    size_t dir_len = last == path ? 1 : (size_t)(last - path);
    char *temp = malloc(dir_len + strlen(temp_name) + 2);
    if (temp == NULL)
        die("out of memory");
    memcpy(temp, path, dir_len);
    temp[dir_len] = '\0';
    if (parents && dir_len > 1)
        make_parents(temp);
    if (temp[dir_len - 1] != '/')
        strcat(temp, "/");
    strcat(temp, temp_name);

    struct stat existing;
    int have = lstat(path, &existing) == 0;
    if (!have && errno != ENOENT)
        refuse_errno(errno, "write", path);
    if (have && !S_ISLNK(existing.st_mode))
        check_kind(existing.st_mode, "write", path);
    int regular = have && S_ISREG(existing.st_mode);
    if (regular) {
        /* A file the user may not write stays unwritten, though its directory would let a rename
         * replace it: opened for writing, touching nothing. */
        int probe = open(path, O_WRONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
        if (probe < 0)
            refuse_errno(errno, "write", path);
        close(probe);
        if (existing.st_uid != geteuid())
            return write_in_place(path, size);
    }
    int fd = open(temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0) {
        if (regular && (errno == EACCES || errno == EPERM || errno == EROFS))
            return write_in_place(path, size); /* the directory is not the user's to write, the file is */
        refuse_errno(errno, "write", path);
    }
    long long came;
    int err = copy_stdin(fd, size, &came);
    if (err == 0 && regular && fchmod(fd, existing.st_mode & 07777) < 0)
        err = errno;
    if (close(fd) < 0 && err == 0)
        err = errno;
    if (err != 0)
        write_failed(err, came, size, path, temp);
    if (rename(temp, path) < 0)
        write_failed(errno, came, size, path, temp);
    return 0;
}

int run_file_mode(int argc, char **argv)
{
    const char *read_path = NULL, *write_path = NULL, *temp_name = NULL;
    long long max_bytes = -1, size = -1;
    int parents = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--make-parents") == 0) {
            parents = 1;
            continue;
        }
        if (v == NULL)
            die("%s wants a value", a);
        if (strcmp(a, "--read-file") == 0)
            read_path = v;
        else if (strcmp(a, "--write-file") == 0)
            write_path = v;
        else if (strcmp(a, "--temp-name") == 0)
            temp_name = v;
        else if (strcmp(a, "--max-bytes") == 0)
            max_bytes = parse_count(v, a);
        else if (strcmp(a, "--size") == 0)
            size = parse_count(v, a);
        else
            die("%s: not an option of --read-file or --write-file", a);
        i++;
    }
    if (read_path != NULL && write_path == NULL && temp_name == NULL && size < 0 && !parents && max_bytes >= 0)
        return read_file(read_path, max_bytes);
    if (write_path != NULL && read_path == NULL && temp_name != NULL && size >= 0 && max_bytes < 0)
        return write_file(write_path, temp_name, size, parents);
    die("usage: dsh-supervise --read-file PATH --max-bytes N\n"
        "       dsh-supervise --write-file PATH --temp-name NAME --size N [--make-parents]");
}
