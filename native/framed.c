/*
 * --frame: the framed command. The supervisor holds fds 0 and 1 alone and carries the command's
 * stdin, stdout, stderr and records over them as frames (the output side is frames.c, the terminal
 * pty.c, the look for a reader of the input waiting.c).
 *
 * --frame (version 2), for harnesses that reach the command through one stream pair (Docker's exec,
 * an SSH channel): the supervisor holds fds 0 and 1 alone; the command's stdin, stdout and stderr
 * are pipes to it. A frame is a type byte, a 4-byte big-endian payload length and the payload.
 *   out (fd 1):  'o' / 'e'  the command's stdout / stderr, at most 65536 bytes a frame; an empty one
 *                           means that stream reached EOF (sent once per stream)
 *                's'        one status record as above, without its newline
 *                'v'        (version 8) what the command wrote to its capture fd: with --capture-fd N
 *                           (--spec: a second payload string N >= 3, where a --fork-server request
 *                           names the status fd; frame mode has none to hand) the command gets a pipe's
 *                           write end at fd N, relayed as the third stream (same frames, an empty one at
 *                           its EOF; nothing at all without the option). A harness keeps a shell
 *                           session's state through it (an EXIT trap writes there)
 *   in (fd 0):   'i' bytes for the command's stdin (queued, unbounded: the harness bounds what waits
 *                by `input drained`); 'c' close its stdin once the queue is written; 'T' / 'K' as the
 *                control bytes; 'P' / 'G' for the side pipe (below); 'W' resizes the terminal (below);
 *                other types are skipped; a
 *                length over 1 MiB, EOF or an error mean the harness is gone (as
 *                control-fd EOF)
 * The side pipe, for a harness that can open this process's fds through /proc (root on the engine's
 * host, or the owner of a rootless engine's user namespace) and wants the output without the relay in
 * between: 'P' makes a pipe and answers `pipe FD INODE` (its read end as this process holds it);
 * the harness opens /proc/PID/fd/FD, checks the inode, and sends 'G' with a nonce of up to 64 bytes.
 * The frames queued until then and an `s` frame `switch` go to fd 1; every later frame goes to the
 * pipe, the first one `nonce HEX` (the nonce in lowercase hex), which proves the pipe is this
 * supervisor's. Requests still come on fd 0; a failed write to the pipe means the harness is gone.
 * Output read before the PROGRAM process was reaped precedes its exit record; `empty` is the last
 * frame. fd 1 is written non-blocking from a bounded buffer: while it holds OUT_LIMIT bytes the
 * command's pipes are not read (the command blocks), but fd 0, signals and kill passes are served.
 *
 * A terminal (version 5: --tty ROWSxCOLS, or the 'x' payload's terminal field with --spec; each a
 * decimal number from 1 to 65535): the command runs on a pseudo-terminal of that size instead of the
 * three pipes. The supervisor makes it (posix_openpt O_NOCTTY, grantpt, unlockpt, TIOCSWINSZ) and
 * holds its master alone; the child, a session leader, opens the slave as fd 0 (which makes it its
 * controlling terminal and the child's group the foreground group) and dup2()s it onto 1 and 2; the
 * supervisor never holds the slave. 'i' bytes are written into the master as they would be typed (a
 * 0x03 is the terminal's interrupt: SIGINT to the foreground group, with the default ISIG; the line
 * discipline echoes them), the master's output is the 'o' stream (the command's stdout and stderr in
 * one, as a terminal shows them), and the 'e' stream's EOF frame is sent at once. A read of EIO from
 * the master means no process holds the slave any more: the 'o' stream's EOF. 'c' is ignored (a
 * terminal is not closed; it ends by hang-up, which a kill brings, or when the supervisor exits and
 * its master closes). 'W' with the payload "R C" (ASCII, one space) sets the size (TIOCSWINSZ: the
 * kernel sends SIGWINCH to the foreground group); without a terminal it is ignored, and a payload that
 * is no such size changes nothing but sends `warning resize 22`. Once no child is left, the terminal's
 * output is read until it is empty (EAGAIN) or EIO, beyond what FIONREAD counts (the line discipline's
 * 4 KiB; more waits in the kernel's buffers) but at most 1 MiB more: a process outside the subtree
 * that opened the slave cannot keep the supervisor by writing. Kills are as without a terminal.
 *
 * --spec (with --frame, within version 4), for a harness that starts supervisors ahead of their
 * commands (a container engine takes tens of milliseconds to start an exec): no PROGRAM on the command
 * line; the supervisor waits on fd 0 for an 'x' frame whose payload is NUL-terminated strings, as a
 * --fork-server request's: ".", "-1", the argument count, PROGRAM and its arguments, then NAME=VALUE
 * entries applied as --setenv (so a value waits in no process). Version 5 allows one more string right
 * after "-1", the terminal field: "-" (no terminal) or "R C" (a terminal of R rows and C columns, as
 * --tty); a payload without it (its third string, the argument count, is all digits) runs without a
 * terminal as before, and a third string that is neither is not a sound frame (125). So the strings
 * ".", "-1", "24 80", "3", "bash", "-c", "tty", "TERM=xterm" (each with its NUL) run `bash -c tty` on
 * a 24x80 terminal. Other frames before it ('W' too) are skipped; EOF before it: exit 0 at once (the
 * spare was not needed). Then it goes on as --frame.
 * Records of frame mode alone (besides those of supervisor.c):
 *   input drained N     --frame only (version 5): the 'i' queue is empty, N bytes of 'i' payload in all
 *                       were written into the command's stdin (decimal, 64-bit); sent at most once a
 *                       poll round and only after progress, so the harness's bytes sent - N is what
 *                       still waits for the command outside the pipe
 *   input broken ERRNO  --frame only (version 5), once: writing the command's stdin failed (32, EPIPE:
 *                       the command closed its read end; 12, ENOMEM: the queue could not grow); the
 *                       queue is dropped, later 'i' frames too, and no `input drained` follows. A
 *                       terminal takes input even when nobody holds its slave, up to its buffer
 *   input busy N        --frame only (version 5), while the command's input is open (a pipe until 'c'
 *   input waiting N     or `input broken`; a terminal): every SAMPLE_MS the supervisor looks down its
 *                       subtree (the children files, at most SAMPLE_MAX processes) for a process in
 *                       state S blocked in read/readv/pread64 of an fd, or in select/pselect6 with nfds
 *                       1 and no write or except set (fd 0), whose /proc/PID/fd/FD is the input: the
 *                       stdin pipe (st_dev and st_ino, taken at spawn) or the terminal (its st_rdev, or
 *                       /dev/tty's (5, 0) in a process whose controlling terminal it is). `waiting` when
 *                       one is and the 'i' queue is empty, else `busy`; N is every 'i' payload byte
 *                       received (and so written) by then, so a harness ignores a report older than its
 *                       last write. Sent on a change only (of the state, or of N while waiting), and
 *                       `input busy 0` right after `started` when the input is open, which says that
 *                       this supervisor samples. Nothing once the input is closed or no child is left.
 *                       Readers in poll/epoll and processes of another uid are not seen (x86_64 and
 *                       aarch64 only; elsewhere never `waiting`)
 */
#include "common.h"
#include "forkserver.h"
#include "frames.h"
#include "kill.h"
#include "pty.h"
#include "supervisor.h"
#include "waiting.h"

#define REQUEST_MAX (1 << 20)    /* a longer frame from the harness cannot be a sound one */
#define TTY_SLACK (1 << 20)      /* terminal output read once no child is left, beyond what FIONREAD says */
#define SAMPLE_MS 200            /* between two looks at the subtree while the input is open */

static unsigned short tty_rows; /* a terminal was asked for: 'c' does not close it */
static int harness_left;  /* fd 0 ended or fd 1 failed */
static int requests_open; /* fd 0 is still read */
/* stdout, stderr, and (--capture-fd) the session capture: a stream that was never open sends nothing. */
#define NSTREAMS 3
static struct stream streams[NSTREAMS] = {{-1, 'o', 0}, {-1, 'e', 0}, {-1, 'v', 0}};
static int capture_pipe[2] = {-1, -1}; /* --capture-fd: [0] ours, [1] the command's */
static int stdin_fd = -1; /* the supervisor's write end of the command's stdin */
static int stdin_closing; /* 'c' came: close once the queue is written */
static unsigned char *stdin_queue;
static size_t stdin_head, stdin_len, stdin_cap;
static unsigned long long stdin_written;  /* 'i' bytes written into the command's stdin so far */
static unsigned long long stdin_reported; /* the count the last `input drained` record gave */
static int stdin_broken;                  /* `input broken` was sent: no more input records */
/* `input waiting` / `input busy`: whether the input's identity was taken (waiting.c), and the last
 * state sent. */
static int input_known;
static int input_waiting = -1; /* -1 nothing sent yet; else the state the last record gave */
static unsigned long long input_waiting_count; /* and its N */
static long long next_sample;
/* The request frame being read from fd 0. */
static unsigned char request[READ_SIZE];
static unsigned char request_header[FRAME_HEADER];
static size_t request_header_len;
static unsigned char request_type;
static size_t request_left; /* payload bytes of the current request frame still to come */
static unsigned char side_nonce[NONCE_MAX];
static size_t side_nonce_len;
static unsigned char resize_text[32]; /* a 'W' payload: "R C" */
static size_t resize_len;             /* its length, counted past the buffer too */
/* Where the loop polled what (-1: not this round). */
static int at_requests = -1, at_stdin = -1, at_out = -1, at_stream[NSTREAMS] = {-1, -1, -1};

/* A command can provoke some records without end (SIGUSR1 to its parent, a lowered RLIMIT_NOFILE);
 * while the harness does not read, they must not grow the buffer, nor crowd out the rest. */
static void frame_record(const char *text, size_t n)
{
    int droppable = strncmp(text, "signalled ", 10) == 0 || strncmp(text, "warning ", 8) == 0;
    frame_out('s', text, n, droppable ? RING_CAP - FINAL_ROOM : RING_CAP);
}

static void close_stdin(void)
{
    if (stdin_fd >= 0)
        close(stdin_fd);
    stdin_fd = -1;
    free(stdin_queue);
    stdin_queue = NULL;
    stdin_head = stdin_len = stdin_cap = 0;
}

/* Writing the command's stdin failed with ERR (EPIPE: the command closed its read end; ENOMEM: the
 * queue could not grow): the harness learns it once, and nothing more reaches the command. */
static void stdin_failed(int err)
{
    close_stdin();
    if (!stdin_broken)
        record("input broken %d", err);
    stdin_broken = 1;
}

/* `input drained N` once the queue is empty and something was written since the last one: the
 * harness's sent bytes minus N are what still waits here, which it bounds. The command can provoke
 * these (by reading) only as often as the harness sends, but a harness that sends and does not read
 * must not crowd out the once-only records: over RECORD_ROOM the record waits (as a count it loses
 * nothing) for room, tried again each poll round. Returns 0 while one is due and did not fit. */
static int report_drained(void)
{
    if (stdin_broken || stdin_len > 0 || stdin_written == stdin_reported)
        return 1;
    char buf[48];
    int n = snprintf(buf, sizeof buf, "input drained %llu", stdin_written);
    if (!frame_out('s', buf, (size_t)n, RING_CAP - FINAL_ROOM) && !frames_dead())
        return 0;
    stdin_reported = stdin_written;
    return 1;
}

/* Nobody is left to ask for a kill: kill everything now, as on control-fd EOF. */
static void harness_gone(void)
{
    if (harness_left)
        return;
    harness_left = 1;
    requests_open = 0;
    want_kill = 1;
    close_stdin();
}

static void queue_stdin(const unsigned char *data, size_t n)
{
    if (stdin_fd < 0 || stdin_closing || n == 0)
        return;
    if (stdin_head + stdin_len + n > stdin_cap) {
        /* Compact when that frees at least half; otherwise grow. Each byte moves O(1) times. */
        if (stdin_head > 0 && stdin_head * 2 >= stdin_cap) {
            memmove(stdin_queue, stdin_queue + stdin_head, stdin_len);
            stdin_head = 0;
        }
        if (stdin_head + stdin_len + n > stdin_cap) {
            size_t cap = stdin_cap ? stdin_cap * 2 : READ_SIZE;
            while (cap < stdin_head + stdin_len + n)
                cap *= 2;
            unsigned char *grown = realloc(stdin_queue, cap);
            if (grown == NULL) {
                /* The command would read a stream with a hole in it: better no more stdin at all. */
                stdin_failed(ENOMEM);
                return;
            }
            stdin_queue = grown;
            stdin_cap = cap;
        }
    }
    memcpy(stdin_queue + stdin_head + stdin_len, data, n);
    stdin_len += n;
}

/* Writes the queue into the command's stdin until the pipe is full; an error (EPIPE: the command
 * closed its stdin) drops the queue. */
static void write_stdin(void)
{
    while (stdin_fd >= 0 && stdin_len > 0) {
        ssize_t n = write(stdin_fd, stdin_queue + stdin_head, stdin_len);
        if (n > 0) {
            stdin_head += (size_t)n;
            stdin_len -= (size_t)n;
            stdin_written += (unsigned long long)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        stdin_failed(n < 0 ? errno : EPIPE); /* a pipe never takes 0 bytes of a non-empty write */
        return;
    }
    stdin_head = 0;
    if (stdin_closing && stdin_fd >= 0)
        close_stdin();
}

/* Reads what fd 0 has and acts on each request frame as its header completes. */
static void read_requests(void)
{
    ssize_t n = read(0, request, sizeof request);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
        return;
    if (n <= 0) {
        harness_gone();
        return;
    }
    for (size_t at = 0; at < (size_t)n;) {
        if (request_left > 0) {
            size_t take = (size_t)n - at < request_left ? (size_t)n - at : request_left;
            if (request_type == 'i')
                queue_stdin(request + at, take);
            else if (request_type == 'G')
                for (size_t k = 0; k < take && side_nonce_len < sizeof side_nonce; k++)
                    side_nonce[side_nonce_len++] = request[at + k];
            else if (request_type == 'W')
                for (size_t k = 0; k < take; k++, resize_len++)
                    if (resize_len < sizeof resize_text)
                        resize_text[resize_len] = request[at + k];
            at += take;
            request_left -= take;
            if (request_left == 0 && request_type == 'G')
                side_switch(side_nonce, side_nonce_len, streams);
            else if (request_left == 0 && request_type == 'W')
                pty_resize(resize_text, resize_len, sizeof resize_text);
            continue;
        }
        request_header[request_header_len++] = request[at++];
        if (request_header_len < FRAME_HEADER)
            continue;
        request_header_len = 0;
        request_type = request_header[0];
        request_left = (size_t)request_header[1] << 24 | (size_t)request_header[2] << 16 |
                       (size_t)request_header[3] << 8 | (size_t)request_header[4];
        if (request_left > REQUEST_MAX) {
            harness_gone(); /* the stream is not the harness's any more */
            return;
        }
        if (request_type == 'c' && tty_rows == 0)
            stdin_closing = 1; /* a terminal is not closed: it ends by hang-up, which a kill brings */
        else if (request_type == 'T')
            want_term = 1;
        else if (request_type == 'K')
            want_kill = 1;
        else if (request_type == 'P')
            side_offer();
        else if (request_type == 'G') {
            side_nonce_len = 0;
            if (request_left == 0)
                side_switch(side_nonce, side_nonce_len, streams);
        } else if (request_type == 'W') {
            resize_len = 0;
            if (request_left == 0)
                pty_resize(resize_text, resize_len, sizeof resize_text);
        }
    }
}

/* No child is left: read what the pipes held at that moment (a process outside the subtree may still
 * hold a write end, and must not keep the supervisor alive by writing), then the EOF frames not sent
 * yet and `empty`. Returns 1 once `empty` is queued, 0 while it waits for room in the ring. */
static int finish_streams(void)
{
    if (!report_drained())
        return 0; /* the count the command read up to belongs before `empty` */
    close_stdin();
    for (int k = 0; k < NSTREAMS; k++) {
        struct stream *s = &streams[k];
        while (s->fd >= 0) {
            if (frames_queued() >= OUT_LIMIT)
                return 0;
            size_t max = s->budget < READ_SIZE ? (size_t)(s->budget > 0 ? s->budget : 0) : READ_SIZE;
            if (max == 0 || read_stream(s, max) == 0) {
                close(s->fd);
                s->fd = -1;
                frame_out(s->type, NULL, 0, RING_CAP);
            }
        }
    }
    record("empty");
    return 1;
}

/* Output already written when the PROGRAM process ended belongs before its exit record. Bounded by
 * the ring: a leftover that writes for ever cannot hold the record back. */
static void drain_ready(void)
{
    for (int k = 0; k < NSTREAMS; k++)
        while (streams[k].fd >= 0 && frames_queued() < OUT_LIMIT && read_stream(&streams[k], READ_SIZE) > 0) {
        }
}

/* Whether the input is open and ours to sample: a pipe until 'c' or EPIPE, a terminal while it is. */
static int input_sampled(void)
{
    return input_known && stdin_fd >= 0 && !stdin_closing && !stdin_broken && child_pid > 0 && proc_fd >= 0;
}

/* `input waiting N` when a process is blocked reading the input with the 'i' queue empty (N: the 'i'
 * bytes received, all written by then), `input busy N` when that stops; sent on a change only (of
 * the state, or of N while waiting). A
 * command can provoke these, so they keep to RECORD_ROOM; one that did not fit is tried again at the
 * next look. */
static void sample_input(void)
{
    next_sample = now_ms() + SAMPLE_MS;
    if (!input_sampled())
        return;
    /* Bytes still in the pipe: the reader was not scheduled yet since they came, so it is not waiting
     * for them, whatever its state says. */
    int unread = 0;
    if (!pty_active() && ioctl(stdin_fd, FIONREAD, &unread) < 0)
        unread = 0;
    int waiting = stdin_len == 0 && unread == 0 && input_waiter();
    /* A reader that took the new bytes and waits again within one look waits anew: its N changed. */
    if (waiting == input_waiting && (!waiting || stdin_written == input_waiting_count))
        return;
    char buf[48];
    int n = snprintf(buf, sizeof buf, "input %s %llu", waiting ? "waiting" : "busy", stdin_written);
    if (frame_out('s', buf, (size_t)n, RING_CAP - FINAL_ROOM) || frames_dead()) {
        input_waiting = waiting;
        input_waiting_count = stdin_written;
    }
}

/* Reads exactly N bytes of fd 0 (blocking or not); 0 at EOF or an error (the harness is gone). */
static int read_fd0(unsigned char *buf, size_t n)
{
    for (size_t got = 0; got < n;) {
        ssize_t r = read(0, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd p = {0, POLLIN, 0};
            (void)poll(&p, 1, -1);
            continue;
        }
        if (r <= 0)
            return 0;
        got += (size_t)r;
    }
    return 1;
}

/* The 'x' payload's optional terminal field, the third string (after the directory and the status
 * fd): "-" (none) or "R C" (a terminal of R rows and C columns). An argument count, which is the third
 * string of a payload without it, is never empty and all digits: that tells them apart. The field is
 * taken out (the rest is parsed as a --fork-server request's payload); returns the new length. */
static size_t take_terminal_field(char *data, size_t len, struct options *o)
{
    if (len == 0 || data[len - 1] != '\0')
        return len; /* not sound: parse_request says so */
    char *field = data;
    for (int k = 0; k < 2 && field < data + len; k++)
        field += strlen(field) + 1;
    if (field >= data + len)
        return len;
    size_t n = strlen(field);
    if (n > 0 && strspn(field, "0123456789") == n)
        return len; /* an argument count: no terminal field */
    if (strcmp(field, "-") != 0 && parse_size(field, n, ' ', &o->tty_rows, &o->tty_cols) != 0)
        die("--spec: not a sound terminal field");
    memmove(field, field + n + 1, (size_t)(data + len - (field + n + 1)));
    return len - (n + 1);
}

/* --spec: waits on fd 0 for the 'x' frame that names the command: NUL-terminated strings as a
 * --fork-server request's payload (a directory, which must be ".", the status fd "-1", the argument
 * count, the arguments, then NAME=VALUE entries applied as --setenv). Frames of other types before
 * it are skipped. EOF first: the spare was not needed; exit 0 without a word. The command, its
 * --setenv entries and its terminal go into O. */
static void read_spec(struct options *o)
{
    for (;;) {
        unsigned char head[FRAME_HEADER];
        if (!read_fd0(head, sizeof head))
            exit(0);
        size_t len = (size_t)head[1] << 24 | (size_t)head[2] << 16 | (size_t)head[3] << 8 | (size_t)head[4];
        if (len > REQUEST_MAX)
            die("--spec: a frame of %zu bytes", len);
        char *data = malloc(len + 1);
        if (data == NULL)
            die("out of memory");
        if (len > 0 && !read_fd0((unsigned char *)data, len))
            exit(0);
        if (head[0] != 'x') {
            free(data);
            continue;
        }
        len = take_terminal_field(data, len, o);
        struct request r;
        if (parse_request(data, len, &r) != 0 || r.cwd == NULL || strcmp(r.cwd, ".") != 0)
            die("--spec: not a sound command frame");
        o->capture_fd = r.status_to; /* frame mode has no status socket to hand: the capture fd (version 8) */
        int count = 0;
        while (r.env[count] != NULL)
            count++;
        char **names = calloc((size_t)count + 1, sizeof *names);
        char **values = calloc((size_t)count + 1, sizeof *values);
        if (names == NULL || values == NULL)
            die("out of memory");
        for (int k = 0; k < count; k++) {
            char *eq = strchr(r.env[k], '=');
            if (eq == NULL || eq == r.env[k])
                die("--spec: an environment entry without NAME=");
            *eq = '\0';
            names[k] = r.env[k];
            values[k] = eq + 1;
        }
        /* The entries are --setenv ones: the supervisor's environment is the base. */
        free(o->program);
        free(o->setenv_names);
        free(o->setenv_values);
        o->program = r.argv;
        o->setenv_names = names;
        o->setenv_values = values;
        o->setenv_count = count;
        return;
    }
}

/* No child is left: the budgets of what the pipes hold now, all that finish_streams will read. */
static void frame_children_gone(void)
{
    for (int k = 0; k < NSTREAMS; k++) {
        int queued = 0;
        if (streams[k].fd >= 0 && ioctl(streams[k].fd, FIONREAD, &queued) == 0)
            streams[k].budget = queued;
    }
    /* The terminal's output may still wait in the kernel's buffers beyond the 4 KiB that FIONREAD
     * counts (a read moves it on); a read that finds nothing (EAGAIN) or EIO ends it anyway, so the
     * budget only bounds a writer outside the subtree that holds the slave. */
    if (pty_active() && streams[0].fd >= 0)
        streams[0].budget += TTY_SLACK;
}

static int frame_ending(void)
{
    static int finished;
    if (!finished)
        finished = finish_streams();
    flush_out();
    if (finished && frames_queued() == 0)
        return END_EXIT;
    /* finish_streams stopped at a full buffer, and that flush made room: read on now. The streams are
     * not polled any more, so waiting here could wait for ever once the flush took all (a reader with
     * a large pipe takes the whole buffer at once). */
    if (!finished && frames_queued() < OUT_LIMIT)
        return END_AGAIN;
    return END_SERVE; /* `empty` is the last frame: no request is served once it is due */
}

static int add_poll(struct pollfd *pfds, int *nfds, int fd, short events)
{
    pfds[*nfds].fd = fd;
    pfds[*nfds].events = events;
    return (*nfds)++;
}

static int frame_polls(struct pollfd *pfds, int nfds, int no_children, int *timeout)
{
    at_requests = at_stdin = at_out = at_stream[0] = at_stream[1] = at_stream[2] = -1;
    /* Written before waiting: most of the time nothing is left to wait for. */
    write_stdin();
    report_drained(); /* so at most one a round, whichever write emptied the queue */
    flush_out();
    if (requests_open)
        at_requests = add_poll(pfds, &nfds, 0, POLLIN);
    for (int k = 0; k < NSTREAMS && !no_children && frames_queued() < OUT_LIMIT; k++)
        if (streams[k].fd >= 0)
            at_stream[k] = add_poll(pfds, &nfds, streams[k].fd, POLLIN);
    if (stdin_fd >= 0 && stdin_len > 0)
        at_stdin = add_poll(pfds, &nfds, stdin_fd, POLLOUT);
    if (frames_queued() > 0)
        at_out = add_poll(pfds, &nfds, out_fd(), POLLOUT);
    if (!no_children && input_sampled()) {
        long long left = next_sample - now_ms();
        if (left <= 0) {
            sample_input();
            flush_out(); /* a record a poll for POLLOUT above did not expect yet */
            left = SAMPLE_MS;
            if (frames_queued() > 0 && at_out < 0)
                at_out = add_poll(pfds, &nfds, out_fd(), POLLOUT);
        }
        if (*timeout < 0 || *timeout > left)
            *timeout = (int)left;
    }
    return nfds;
}

static void frame_serve(const struct pollfd *pfds)
{
    if (at_requests >= 0 && pfds[at_requests].revents)
        read_requests();
    for (int k = 0; k < NSTREAMS; k++)
        if (at_stream[k] >= 0 && pfds[at_stream[k]].revents && streams[k].fd >= 0 && frames_queued() < OUT_LIMIT)
            read_stream(&streams[k], READ_SIZE);
    if (at_stdin >= 0 && pfds[at_stdin].revents)
        write_stdin();
    if (at_out >= 0 && pfds[at_out].revents)
        flush_out();
}

/* The supervisor's ends of the command's pipes (or the terminal's master) become its own, non-blocking
 * (their own open files: the command's ends stay blocking), and so do fds 0 and 1. */
static void own_ends(int stdio_pipe[3][2])
{
    if (tty_rows == 0) {
        close(stdio_pipe[0][0]);
        close(stdio_pipe[1][1]);
        close(stdio_pipe[2][1]);
        stdin_fd = stdio_pipe[0][1];
        streams[0].fd = stdio_pipe[1][0];
        streams[1].fd = stdio_pipe[2][0];
    }
    if (capture_pipe[1] >= 0) {
        close(capture_pipe[1]);
        streams[2].fd = capture_pipe[0];
    }
    int own[4] = {stdin_fd, streams[0].fd, streams[1].fd, streams[2].fd};
    for (int k = 0; k < 4; k++)
        if (own[k] >= 0 && fcntl(own[k], F_SETFL, O_NONBLOCK) < 0)
            die("fcntl(O_NONBLOCK): %s", strerror(errno));
    /* One slow reader of fd 1 must never stall kill requests; fd 0 too, which may share its open file
     * (one socket as both). This changes the flags of the harness's open file descriptions. */
    int fl0 = fcntl(0, F_GETFL), fl1 = fcntl(1, F_GETFL);
    if (fl0 < 0 || fl1 < 0 || fcntl(0, F_SETFL, fl0 | O_NONBLOCK) < 0 || fcntl(1, F_SETFL, fl1 | O_NONBLOCK) < 0)
        die("fcntl(O_NONBLOCK) on fds 0 and 1: %s", strerror(errno));
    requests_open = 1;
}

/* What the command's input is, as stat(2) of a reader's fd shows it: taken once, while the terminal's
 * slave surely exists and before the pipe could be closed. Then `input busy 0` says that this
 * supervisor samples, so the harness can tell "not waiting" from "cannot tell". */
static void start_sampling(const char *slave)
{
    struct stat st;
    if (pty_active() && stat(slave, &st) == 0 && st.st_rdev != 0) {
        input_identity(1, st.st_rdev, 0);
        input_known = 1;
    } else if (!pty_active() && stdin_fd >= 0 && fstat(stdin_fd, &st) == 0) {
        input_identity(0, st.st_dev, st.st_ino);
        input_known = 1;
    }
    if (input_sampled() && frame_out('s', "input busy 0", 12, RING_CAP))
        input_waiting = 0;
    next_sample = now_ms() + SAMPLE_MS;
}

int run_framed(struct options *o)
{
    record_to(frame_record);
    frames_init(harness_gone);
    if (fcntl(0, F_GETFD) < 0 || fcntl(1, F_GETFD) < 0)
        die("--frame needs fds 0 and 1 open (the harness's stream)");
    /* A closed fd 2 would be handed to one of the command's pipes below, then replaced by /dev/null
     * after the spawn. */
    if (fcntl(2, F_GETFD) < 0 && open("/dev/null", O_RDWR) != 2)
        die("cannot open /dev/null as fd 2");
    if (o->spec)
        read_spec(o); /* a spare started ahead of its command: the command comes now, on fd 0 */
    tty_rows = o->tty_rows;
    clear_arguments(o);
    take_signals(0);
    prepare_supervisor();
    check_supervisor(o->allow_no_subreaper);
    /* Who to continue (SIGCONT) from outside when a command stopped this supervisor: the harness checks
     * the start time before it signals the pid. Out before the command runs, whatever its first act is
     * (stopping us, say): frames are written by the loop below otherwise, which a stopped supervisor
     * never reaches (1 s bound). Not before a spare's spec: a waiting spare says nothing (the harness
     * takes a spare that spoke for a dead one). */
    record("supervisor %d %llu", (int)getpid(), own_start_time());
    for (int tries = 0; frames_queued() > 0 && !frames_dead() && tries < 100; tries++) {
        flush_out();
        if (frames_queued() > 0) {
            struct pollfd ready = {out_fd(), POLLOUT, 0};
            (void)poll(&ready, 1, 10);
        }
    }
    /* The command's stdin, stdout and stderr, [0] its read end, [1] its write end. All close-on-exec:
     * the child dup2()s its own ends onto 0-2 and inherits none of the others. */
    int stdio_pipe[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
    char slave[64];
    if (o->stdin_null && tty_rows > 0)
        die("--stdin-null goes with no terminal (the --spec payload asked for one)");
    int pty_err = 0; /* a terminal was asked for and could not be made: this errno */
    if (tty_rows > 0) {
        pty_err = pty_open(o->tty_rows, o->tty_cols, slave, sizeof slave, &stdin_fd, &streams[0].fd);
    } else {
        for (int k = o->stdin_null ? 1 : 0; k < 3; k++)
            if (pipe2(stdio_pipe[k], O_CLOEXEC) < 0)
                die("pipe2: %s", strerror(errno));
        /* --stdin-null (version 6): a command given no input reads /dev/null, as the harness's contract
         * says, not an empty pipe; 'i' and 'c' frames then have nothing to write to. */
        if (o->stdin_null && (stdio_pipe[0][0] = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0)
            die("cannot open /dev/null: %s", strerror(errno));
    }
    /* --capture-fd (version 8): a pipe the command gets at that fd, relayed as 'v' frames. */
    if (o->capture_fd >= 0 && pipe2(capture_pipe, O_CLOEXEC) < 0)
        die("pipe2: %s", strerror(errno));
    struct launch l = {o->program,
                       command_environment(environ, o),
                       {stdio_pipe[0][0], stdio_pipe[1][1], stdio_pipe[2][1]},
                       pty_active() ? slave : NULL,
                       0,
                       -1,
                       capture_pipe[1],
                       o->capture_fd};
    /* Over the harness's stream: from here on the command reaches it only through us. */
    int exec_err = pty_err != 0 ? pty_err : spawn_command(&l);
    own_ends(stdio_pipe);
    settle_stdio(2, -1);
    if (report_start(pty_err, exec_err))
        start_sampling(slave);
    /* A terminal is one stream: the command's stderr is its stdout, so stderr ends at once. */
    if (tty_rows > 0) {
        if (streams[0].fd < 0)
            frame_out('o', NULL, 0, RING_CAP);
        frame_out('e', NULL, 0, RING_CAP);
    }
    struct mode m = {.control_fd = -1,
                     .grace_ms = o->grace_ms,
                     .program_ended = drain_ready,
                     .children_gone = frame_children_gone,
                     .ending = frame_ending,
                     .add_polls = frame_polls,
                     .serve_polls = frame_serve};
    return supervise(&m);
}
