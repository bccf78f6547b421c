/*
 * --detach (version 3), for background tasks that must outlive the harness's channel (an SSH
 * connection that drops): no channel can carry the records, so they go to a file the command could
 * append to as well, and each is signed. PR_SET_DUMPABLE 0 comes first of all (no process of the
 * user can read this one's memory); then exactly 32 bytes of key are read from fd 0 (fewer: 125);
 * the status file is created O_EXCL|O_NOFOLLOW, mode 0600 (an existing path or a link: 125), and so
 * are the stdout and stderr files when given (else /dev/null); the stdin file is opened read-only
 * (O_NOFOLLOW; else /dev/null). Then it forks: the child calls setsid(), writes its first record
 * `supervisor PID STARTTIME` (STARTTIME: field 22 of /proc/self/stat), becomes the subreaper, points
 * fds 0-2 at /dev/null and tells the parent, which exits 0 (or 125 with the child's reason on
 * stderr, if it failed first); the child runs PROGRAM as above with fds 0-2 = those files.
 * Each record is one line, one write(2) in O_APPEND mode: `SEQ RECORD MAC`, SEQ counting from 0 and
 * MAC the lowercase hex HMAC-SHA256 under the key of the bytes before the last space. A write that
 * fails (a full file system) drops the record without advancing SEQ; `warning dropped N` precedes
 * the next record written. Kill requests: SIGUSR1 and SIGUSR2 only. The key stays in this process's
 * memory only (as the two HMAC states; the read buffer is wiped).
 *
 * --cap-bytes N (with --detach and both --stdout-file and --stderr-file): the command's stdout and
 * stderr are pipes, relayed into their files by the supervisor, which writes a file only while the
 * disk space it holds (st_blocks * 512, plus one block for rounding) stays within N bytes. A full
 * file is not written (and its pipe not read: the command blocks) until the harness frees space in
 * it (it punches holes into what it has read) or raises the cap, looked at again every RELAY_WAIT_MS.
 * --cap-file PATH: the harness raises (or sets) the caps there, as two decimal numbers (stdout's,
 * stderr's); read while a file is full, through no link and only from a regular file. After a kill
 * request, or once the file was removed (no link left), or after a write error, the stream's output
 * is read and dropped instead. `empty` follows the EOF of both pipes. This makes the harness's
 * spill budget a bound on the disk at every moment, however fast the command writes.
 */
#include "common.h"
#include "sha256.h"
#include "supervisor.h"

#define KEY_SIZE 32
#define RELAY_WAIT_MS 10

/* Records are signed lines appended to a file (status_fd) that the command can write too. */
static struct hmac record_key;          /* the HMAC states under the harness's key; the key is wiped */
static unsigned long long record_seq;   /* SEQ of the next record */
static unsigned long long records_lost; /* not written (a full file system) since the last report */
static int ready_fd = -1; /* until the detached supervisor is ready: the parent waits on it */
/* --cap-bytes: the relays of stdout and stderr into their files. */
static long long cap_bytes = -1;
static long long relay_cap[2];
static char *cap_path;
static int relay_pipe[2] = {-1, -1}; /* read ends of the command's stdout and stderr, -1 at EOF */
static int relay_file[2] = {-1, -1};
static int relay_drop[2];            /* read and dropped from now on */
static void signed_record(const char *text, size_t n);

/* --detach: appends "SEQ TEXT MAC\n" with one write(2) (O_APPEND: whole, after whatever the command
 * appended). SEQ advances only once the whole line is written: after a failed or short write (a full
 * file system, a lowered RLIMIT_FSIZE) the next record reuses it, so that the harness's strict SEQ
 * check still accepts it; glued to the partial line, it is that line's verifiable tail. Nothing is
 * retried: a supervisor must never block on its status file. Returns 0 when the line was written. */
static int signed_write(const char *text, size_t n)
{
    char line[256];
    int len = snprintf(line, sizeof line - 66, "%llu %.*s", record_seq, (int)n, text);
    if (len < 0 || len >= (int)sizeof line - 66)
        return -1;
    line[len] = ' ';
    hmac_hex(&record_key, line, (size_t)len, line + len + 1);
    line[len + 65] = '\n';
    size_t total = (size_t)len + 66;
    ssize_t w;
    do
        w = write(status_fd, line, total);
    while (w < 0 && errno == EINTR);
    if (w != (ssize_t)total)
        return -1;
    record_seq++;
    return 0;
}

/* --cap-file: the caps the harness wrote last (left as they are when it cannot be read). */
static void read_caps(void)
{
    if (cap_path == NULL)
        return;
    int fd = open(cap_path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return;
    char text[64];
    struct stat st;
    ssize_t n = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) ? read(fd, text, sizeof text - 1) : -1;
    close(fd);
    if (n <= 0)
        return;
    text[n] = '\0';
    long long out, err;
    if (sscanf(text, "%lld %lld", &out, &err) == 2 && out >= 0 && err >= 0) {
        relay_cap[0] = out;
        relay_cap[1] = err;
    }
}

/* --cap-bytes: moves what stream K's pipe holds into its file while the file stays within the cap.
 * Returns 1 when the file is full (the pipe is left unread: look again after RELAY_WAIT_MS). */
static int relay(int k)
{
    static char buf[READ_SIZE];
    for (int rounds = 0; rounds < 16 && relay_pipe[k] >= 0; rounds++) {
        size_t room = sizeof buf;
        if (!relay_drop[k]) {
            struct stat st;
            if (fstat(relay_file[k], &st) < 0 || st.st_nlink == 0) {
                relay_drop[k] = 1; /* removed (the harness gave the task up): nobody reads it */
            } else {
                long long used = (long long)st.st_blocks * 512 + 4096;
                if (used >= relay_cap[k])
                    read_caps(); /* full: the harness may have granted more */
                if (used >= relay_cap[k])
                    return 1;
                if (relay_cap[k] - used < (long long)room)
                    room = (size_t)(relay_cap[k] - used);
            }
        }
        ssize_t n = read(relay_pipe[k], buf, room);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (n <= 0) {
            close(relay_pipe[k]);
            relay_pipe[k] = -1;
            return 0;
        }
        for (ssize_t done = 0; done < n && !relay_drop[k];) {
            ssize_t w = write(relay_file[k], buf + done, (size_t)(n - done));
            if (w > 0)
                done += w;
            else if (!(w < 0 && errno == EINTR))
                relay_drop[k] = 1; /* a full file system, RLIMIT_FSIZE: these bytes are lost */
        }
    }
    return 0;
}

/* A file the harness named, created here: never one that existed, nor a link (whoever planted it
 * would choose where the records or the output go, or read them). */
static int create_file(const char *path, const char *what)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY, 0600);
    if (fd < 0)
        die("cannot create the %s file %s: %s", what, path, strerror(errno));
    return fd;
}


/* Reads the key from fd 0, creates the files and forks. Returns in the child only, which has left
 * the harness's session; the parent waits until the child is ready (exit 0) or failed (exit 125,
 * with the child's reason on stderr), so that the harness knows the outcome of the start when the
 * channel closes. STDIO gets the command's stdin, stdout and stderr (close-on-exec). */
static void detach(const char *status_path, char *const paths[3], int stdio[3])
{
    unsigned char key[KEY_SIZE];
    int short_key = read_exact(0, key, sizeof key) < 0;
    if (!short_key)
        hmac_init(&record_key, key, sizeof key);
    record_to(signed_record);
    wipe(key, sizeof key);
    if (short_key)
        die("--detach wants %d bytes of key on fd 0 and got fewer", KEY_SIZE);
    /* fds 0-2 are pointed at /dev/null later: none of the files may be opened onto one of them. */
    for (int fd = 1; fd <= 2; fd++)
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) != fd)
            die("cannot open /dev/null as fd %d", fd);
    status_fd = create_file(status_path, "status");
    for (int k = 0; k < 3; k++) {
        if (paths[k] == NULL)
            stdio[k] = open("/dev/null", (k == 0 ? O_RDONLY : O_WRONLY) | O_CLOEXEC);
        else if (k == 0)
            stdio[k] = open(paths[k], O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY);
        else
            stdio[k] = create_file(paths[k], k == 1 ? "stdout" : "stderr");
        if (stdio[k] < 0)
            die("cannot open %s: %s", paths[k] != NULL ? paths[k] : "/dev/null", strerror(errno));
    }
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) < 0)
        die("pipe2: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid > 0) {
        /* A NUL byte: ready. Anything else: the child's reason for failing, then EOF. */
        char buf[600];
        size_t got = 0;
        close(ready[1]);
        while (got < sizeof buf) {
            ssize_t r = read(ready[0], buf + got, sizeof buf - got);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0)
                break;
            got += (size_t)r;
            if (buf[0] == '\0')
                _exit(0);
        }
        if (got == 0)
            die("the detached supervisor ended before it was ready");
        if (write(2, "dsh-supervise: ", 15) < 0 || write(2, buf, got) < 0) {
            /* nothing left to tell */
        }
        _exit(EXIT_SETUP);
    }
    close(ready[0]);
    ready_fd = ready[1];
    die_to(ready_fd);
    /* Out of the harness's session and process group: its hangup, its group's signals and its
     * channel's end are no concern of the supervisor's. */
    if (setsid() < 0)
        die("setsid: %s", strerror(errno));
}

/* The harness learns that records are missing (and how many) with the next one written. */
static void signed_record(const char *text, size_t n)
{
    if (records_lost > 0) {
        char note[48];
        int k = snprintf(note, sizeof note, "warning dropped %llu", records_lost);
        if (signed_write(note, (size_t)k) == 0)
            records_lost = 0;
    }
    if (signed_write(text, n) < 0)
        records_lost++;
}

/* No writer is left: what the relayed pipes hold is all there is; `empty` waits for it. */
static int detached_ending(void)
{
    if (relay_pipe[0] >= 0 || relay_pipe[1] >= 0)
        return END_SERVE;
    record("empty");
    return END_EXIT;
}

static int relay_polls(struct pollfd *pfds, int nfds, int no_children, int *timeout)
{
    int relay_full = 0;
    for (int k = 0; k < 2; k++) {
        if (relay_pipe[k] < 0)
            continue;
        if (relay(k)) {
            relay_full = 1;
        } else if (relay_pipe[k] >= 0) {
            pfds[nfds].fd = relay_pipe[k];
            pfds[nfds++].events = POLLIN;
        }
    }
    if (no_children && relay_pipe[0] < 0 && relay_pipe[1] < 0 && cap_bytes >= 0)
        return -1; /* the last output just reached its file: `empty` is due, nothing to wait for */
    if (relay_full && (*timeout < 0 || *timeout > RELAY_WAIT_MS))
        *timeout = RELAY_WAIT_MS; /* a full file may have room again by then */
    return nfds;
}

/* A killed task's output is of no use to anyone: it must not keep the supervisor. */
static void drop_output(void)
{
    relay_drop[0] = relay_drop[1] = 1;
}

/* --cap-bytes: the command writes pipes, the supervisor its files (see relay()). STDIO[1] and
 * STDIO[2] become the pipes' write ends. */
static void start_relays(int stdio[3])
{
    for (int k = 0; k < 2; k++) {
        int relay_ends[2];
        if (pipe2(relay_ends, O_CLOEXEC) < 0 || fcntl(relay_ends[0], F_SETFL, O_NONBLOCK) < 0)
            die("pipe2: %s", strerror(errno));
        relay_file[k] = stdio[k + 1];
        relay_pipe[k] = relay_ends[0];
        stdio[k + 1] = relay_ends[1]; /* the command's; closed here once it is spawned */
    }
}

int run_detached(struct options *o)
{
    int stdio[3] = {-1, -1, -1};
    cap_bytes = o->cap_bytes;
    relay_cap[0] = relay_cap[1] = cap_bytes;
    cap_path = o->cap_path;
    clear_arguments(o);
    take_signals(1);
    /* The subreaper must be the long-lived process: everything from here on is in the child. */
    detach(o->status_path, o->stdio_paths, stdio);
    record("supervisor %d %llu", (int)getpid(), own_start_time());
    if (record_seq == 0)
        die("cannot write the status file: %s", strerror(errno));
    prepare_supervisor();
    check_supervisor(o->allow_no_subreaper);
    /* Then the parent may go; from here on the status file is the only channel. */
    stdio_to_null();
    char ready = '\0';
    if (write(ready_fd, &ready, 1) != 1)
        die("cannot tell the parent: %s", strerror(errno));
    close(ready_fd);
    ready_fd = -1;
    die_to(-1);
    if (cap_bytes >= 0)
        start_relays(stdio);
    struct launch l = {o->program, command_environment(environ, o), {stdio[0], stdio[1], stdio[2]}, NULL, 0, -1, -1, -1};
    int err = spawn_command(&l);
    for (int k = 0; k < 3; k++)
        close(stdio[k]); /* the command's alone: no EOF of theirs waits for the supervisor */
    settle_stdio(0, -1);
    report_start(0, err);
    struct mode m = {.control_fd = -1,
                     .grace_ms = o->grace_ms,
                     .ending = detached_ending,
                     .add_polls = relay_polls,
                     .kill_asked = drop_output};
    return supervise(&m);
}
