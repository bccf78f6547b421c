/* Frame mode's output side: the ring of frames bound for fd 1 (or the side pipe), and the side pipe
 * itself ('P', 'G'; the protocol is in framed.c's header). */
#include "common.h"
#include "frames.h"

/* What goes out on fd 1, framed, in a ring (never more than RING_CAP bytes in memory). */
static unsigned char ring[RING_CAP];
static size_t ring_head, ring_len;
static int out_dead; /* writing fd 1 failed: nobody reads, output is dropped from now on */
static void (*harness_gone)(void);
/* The side pipe ('P', 'G'): frames move from fd 1 to a pipe the harness opened itself. */
static int side_pipe[2] = {-1, -1};
static int side_switched;    /* frames after the `switch` record go to side_pipe[1] */
static size_t side_fd1_left; /* ring bytes still owed to fd 1 (up to and with `switch`) */

void frames_init(void (*gone)(void))
{
    harness_gone = gone;
}

size_t frames_queued(void)
{
    return ring_len;
}

int frames_dead(void)
{
    return out_dead;
}

static void ring_put(size_t at, const void *data, size_t n)
{
    size_t pos = (ring_head + at) % RING_CAP, first = RING_CAP - pos;
    if (first > n)
        first = n;
    memcpy(ring + pos, data, first);
    memcpy(ring, (const unsigned char *)data + first, n - first);
}

static void put_header(size_t at, char type, size_t n)
{
    unsigned char h[FRAME_HEADER] = {(unsigned char)type, (unsigned char)(n >> 24), (unsigned char)(n >> 16),
                                     (unsigned char)(n >> 8), (unsigned char)n};
    ring_put(at, h, sizeof h);
}

/* Appends a whole frame when it fits under LIMIT (returns 1 then); the caller has made sure the
 * essential ones do. */
int frame_out(char type, const void *data, size_t n, size_t limit)
{
    if (out_dead || ring_len + FRAME_HEADER + n > limit)
        return 0;
    put_header(ring_len, type, n);
    if (n > 0)
        ring_put(ring_len + FRAME_HEADER, data, n);
    ring_len += FRAME_HEADER + n;
    return 1;
}

/* Where the next ring byte goes: fd 1, or the side pipe once everything owed to fd 1 went out. */
int out_fd(void)
{
    return side_switched && side_fd1_left == 0 ? side_pipe[1] : 1;
}

/* Writes fd 1 until it would block. An error there means nobody reads: the harness is gone. */
void flush_out(void)
{
    while (ring_len > 0 && !out_dead) {
        struct iovec iov[2];
        size_t len = ring_len;
        if (side_fd1_left > 0 && len > side_fd1_left)
            len = side_fd1_left;
        size_t first = RING_CAP - ring_head;
        if (first > len)
            first = len;
        iov[0].iov_base = ring + ring_head;
        iov[0].iov_len = first;
        iov[1].iov_base = ring;
        iov[1].iov_len = len - first;
        ssize_t n = writev(out_fd(), iov, len > first ? 2 : 1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            out_dead = 1;
            harness_gone();
            break;
        }
        ring_head = (ring_head + (size_t)n) % RING_CAP;
        ring_len -= (size_t)n;
        if (side_fd1_left > 0)
            side_fd1_left -= (size_t)n;
    }
    if (out_dead)
        ring_len = 0;
    if (ring_len == 0)
        ring_head = 0; /* the next frames start contiguous: fewer two-part writes */
}

/* Reads one chunk (at most MAX bytes) of the command's pipe straight into the ring as a frame; the
 * caller has checked that ring_len < OUT_LIMIT, which leaves room for a whole read. Returns 1 when
 * it read something, 0 when the pipe is empty for now, -1 when it reached EOF (frame sent, fd closed). */
int read_stream(struct stream *s, size_t max)
{
    if (max > READ_SIZE)
        max = READ_SIZE;
    size_t start = (ring_head + ring_len + FRAME_HEADER) % RING_CAP, first = RING_CAP - start;
    struct iovec iov[2];
    iov[0].iov_base = ring + start;
    iov[0].iov_len = first < max ? first : max;
    iov[1].iov_base = ring;
    iov[1].iov_len = max - iov[0].iov_len;
    ssize_t n;
    do
        n = readv(s->fd, iov, iov[1].iov_len ? 2 : 1);
    while (n < 0 && errno == EINTR);
    if (n > 0) {
        if (!out_dead) {
            put_header(ring_len, s->type, (size_t)n);
            ring_len += FRAME_HEADER + (size_t)n;
        }
        s->budget -= n;
        return 1;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0;
    close(s->fd);
    s->fd = -1;
    frame_out(s->type, NULL, 0, RING_CAP);
    return -1;
}

/* 'P': make the side pipe and say where its read end is (`pipe FD INODE`), so that a harness that
 * may open this process's fds (through /proc/PID/fd/FD: root, or the owner of a user namespace; a
 * same-user command may not, this process being non-dumpable) can read the frames from it instead
 * of fd 1, past whatever relays fd 1 (a container engine copies every byte twice more). Once only;
 * nothing changes until 'G'. */
void side_offer(void)
{
    if (side_pipe[0] >= 0 || side_switched || out_dead)
        return;
    if (pipe2(side_pipe, O_CLOEXEC | O_NONBLOCK) < 0) {
        record("warning pipe %d", errno);
        side_pipe[0] = side_pipe[1] = -1;
        return;
    }
    (void)fcntl(side_pipe[1], F_SETPIPE_SZ, 1 << 20); /* fewer wake-ups; the default 64 KiB also works */
    struct stat st;
    if (fstat(side_pipe[0], &st) < 0)
        st.st_ino = 0;
    record("pipe %d %llu", side_pipe[0], (unsigned long long)st.st_ino);
}

/* 'G' NONCE: the harness holds the read end now. Every frame queued so far, then `switch`, still go
 * to fd 1; the next frame, on the side pipe, is `nonce NONCE`, which tells the harness that it opened
 * this process's pipe. The harness reading fd 1 learns from `switch` that nothing more comes there. */
void side_switch(const unsigned char *nonce, size_t nonce_len, const struct stream streams[2])
{
    if (side_pipe[0] < 0 || side_switched || out_dead)
        return;
    close(side_pipe[0]); /* from now on the harness's end alone: its EPIPE means it is gone */
    side_pipe[0] = -1;
    /* The command's pipes grow too (fewer wake-ups on both sides), only now that the harness reads
     * fast: before, a command could end with much output still in them, which the harness must then
     * drain under its bound after the exit record. Only for a command with much output: larger pipes
     * for every command would spend the user's pipe-user-pages-soft, past which the kernel gives new
     * pipes one page. */
    for (int k = 0; k < 2; k++)
        if (streams[k].fd >= 0)
            (void)fcntl(streams[k].fd, F_SETPIPE_SZ, 1 << 20);
    frame_out('s', "switch", 6, RING_CAP);
    side_fd1_left = ring_len;
    side_switched = 1;
    char text[8 + 2 * NONCE_MAX] = "nonce ";
    size_t n = 6;
    static const char hex[] = "0123456789abcdef";
    for (size_t k = 0; k < nonce_len && k < NONCE_MAX; k++) {
        text[n++] = hex[nonce[k] >> 4];
        text[n++] = hex[nonce[k] & 15];
    }
    frame_out('s', text, n, RING_CAP);
}
