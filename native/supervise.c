/*
 * dsh-supervise: a per-command subreaper for dsh-bash.
 *
 *   dsh-supervise [--status-fd N] [--control-fd N] [--die-with-parent] [--allow-no-subreaper]
 *                 [--setenv NAME=VALUE]... -- PROGRAM [ARGS...]
 *   dsh-supervise --frame [--tty ROWSxCOLS] [--allow-no-subreaper] [--setenv NAME=VALUE]...
 *                 -- PROGRAM [ARGS...]
 *   dsh-supervise --frame --spec [--allow-no-subreaper]
 *   dsh-supervise --detach --status-file PATH [--stdin-file PATH] [--stdout-file PATH]
 *                 [--stderr-file PATH] [--cap-bytes N [--cap-file PATH]] [--allow-no-subreaper]
 *                 [--setenv NAME=VALUE]...
 *                 -- PROGRAM [ARGS...]
 *   dsh-supervise --fork-server [--die-with-parent] [--allow-no-subreaper]
 *   dsh-supervise --version      (prints "dsh-supervise 5": the protocol's version)
 *   dsh-supervise --sha256 | --hmac-sha256 KEYHEX   (digest of stdin in hex: for the tests)
 *
 * It makes itself a child subreaper and non-dumpable, forks PROGRAM into a session and process group
 * of its own, reports what happens on the status fd (ASCII lines, one write(2) each), reaps every
 * process that ends up as its child (orphaned descendants re-parent to it), kills its whole subtree
 * on request, and exits 0 once it has no children left.
 *
 * Status records (only with --status-fd):
 *   started PID         PROGRAM was exec'd (PID leads its own session and process group)
 *   execfail ERRNO      exec failed (an `exit 127` record follows for the child that reported it)
 *   ptyfail ERRNO       --frame with a terminal (version 5): the pseudo-terminal could not be made (no
 *                       devpts where the supervisor runs, say); nothing was started, `exit 127` follows
 *   exit CODE           the PROGRAM process exited (descendants may live on)
 *   signal NUM[ core]   the PROGRAM process was killed by a signal
 *   signalled N         answer to a kill request: N processes signalled by its first pass
 *   supervisor PID T    --detach only, always the first: the detached supervisor's pid and start time
 *   warning TEXT        something degraded (e.g. `warning proc-scan ERRNO`); consumers may ignore it
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
 *   empty               no child is left at all; the supervisor exits 0 right after
 *
 * Kill requests: SIGUSR1 or byte 'T' on the control fd sends SIGTERM (then SIGCONT) to every live
 * descendant; SIGUSR2 or byte 'K' sends SIGKILL to every descendant and repeats scan+kill passes
 * until a scan finds none alive. EOF on the control fd (or SIGUSR2 from --die-with-parent) means the
 * harness is gone: kill everything and exit once empty.
 *
 * --frame (version 2), for harnesses that reach the command through one stream pair (Docker's exec,
 * an SSH channel): the supervisor holds fds 0 and 1 alone; the command's stdin, stdout and stderr
 * are pipes to it. A frame is a type byte, a 4-byte big-endian payload length and the payload.
 *   out (fd 1):  'o' / 'e'  the command's stdout / stderr, at most 65536 bytes a frame; an empty one
 *                           means that stream reached EOF (sent once per stream)
 *                's'        one status record as above, without its newline
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
 *
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
 *
 * --setenv NAME=VALUE (version 4, repeatable, every mode): the child sets NAME to VALUE (replacing any
 * inherited value; a later --setenv of the same NAME wins) right before it execs PROGRAM. The
 * supervisor's own environment is left as it was: a variable meant for the command alone (the
 * harness's marker, which a kill by marker looks for in /proc/PID/environ) never marks the
 * supervisor, and it costs no `env` exec in between. The values are copied before the argument area
 * is cleared, so /proc/PID/cmdline of the supervisor shows none of them either. No '=' or an empty
 * NAME: 125. A setenv(3) that fails in the child is reported as an exec failure (`execfail ERRNO`).
 *
 * --fork-server (version 4), one per harness (executor), so that a command costs a fork instead of an
 * exec: fd 0 is a Unix stream socket. The server keeps a spare child ready (announced on fd 0 as
 * `spare PID` with a pidfd attached), which takes the next request from fd 0 and becomes that
 * command's supervisor as in the status-fd mode with --die-with-parent (its parent is the server). A
 * request: a 4-byte big-endian length, then NUL-terminated strings (directory, the fd at which the
 * program gets the status socket too or -1, argument count, arguments, environment entries), with
 * exactly four fds attached (status socket, stdin, stdout, stderr). The supervisor's first message is `pidfd PID` with a pidfd of itself attached, sent with
 * its first records; `cwdfail ERRNO` when the directory cannot be entered. EOF on fd 0 or the
 * server's death ends every supervisor under it (PDEATHSIG SIGUSR2). A malformed request: 125.
 *
 * PROGRAM is started by posix_spawnp (a clone sharing memory until the exec): default dispositions,
 * empty mask, a session of its own; PATH is searched in the command's environment. In the status-fd
 * modes, records of one moment are written together, before the supervisor blocks or exits.
 *
 * --allow-no-subreaper: where PR_SET_CHILD_SUBREAPER is refused (qemu-user emulates no such prctl), go
 * on after `warning no-subreaper ERRNO` instead of failing; orphans then escape to init. For tests.
 *
 * Exit status: 0 after `empty`; 125 for usage and setup errors (a message on stderr).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef PR_SET_CHILD_SUBREAPER
#define PR_SET_CHILD_SUBREAPER 36
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef __WALL
#define __WALL 0x40000000
#endif

#define VERSION "5"
#define EXIT_SETUP 125
#define TABLE_CAP 65536          /* processes one /proc scan can hold */
#define MEMO_SLOTS (2 * TABLE_CAP) /* power of two */
#define CHAIN_MAX 4096           /* ppid hops when checking that a process is still ours */
#define PASS_MIN_MS 2            /* pause between SIGKILL passes, doubling up to PASS_MAX_MS */
#define PASS_MAX_MS 50
#define WALK_ROUNDS 64           /* children-file walks per pass, while they find new processes */

/* --frame */
#define FRAME_HEADER 5
#define READ_SIZE 65536          /* one read of a command pipe, or of fd 0; the largest payload sent */
#define OUT_LIMIT (256 * 1024)   /* buffered output at which the command's pipes are no longer read */
#define RECORD_ROOM 16384        /* beyond it, for records a command can provoke (signalled, warning,
                                    input drained, input waiting / busy) */
#define FINAL_ROOM 1024          /* kept for the once-only ones: started, exit, EOF frames, empty,
                                    pipe, switch, nonce, input broken, the first input busy */
#define RING_CAP (OUT_LIMIT + FRAME_HEADER + READ_SIZE + RECORD_ROOM + FINAL_ROOM)
#define REQUEST_MAX (1 << 20)    /* a longer frame from the harness cannot be a sound one */
#define TTY_SLACK (1 << 20)      /* terminal output read once no child is left, beyond what FIONREAD says */

/* ---- SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for --detach's signed records ----------- */

/* Section 4.2.2: the first 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const unsigned int sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

struct sha256 {
    unsigned int h[8];
    unsigned char block[64];
    size_t used;              /* bytes in block[] */
    unsigned long long bytes; /* message length so far */
};

/* Overwrites secret bytes in a way the compiler may not drop as a dead store. */
static void wipe(void *p, size_t n)
{
    volatile unsigned char *v = p;
    while (n--)
        *v++ = 0;
}

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

/* Section 6.2.2: one 512-bit block into the state. */
static void sha256_block(unsigned int h[8], const unsigned char *p)
{
    unsigned int w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (unsigned int)p[4 * t] << 24 | (unsigned int)p[4 * t + 1] << 16 | (unsigned int)p[4 * t + 2] << 8 |
               (unsigned int)p[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        unsigned int s0 = ROTR(w[t - 15], 7) ^ ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
        unsigned int s1 = ROTR(w[t - 2], 17) ^ ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    unsigned int a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int t = 0; t < 64; t++) {
        unsigned int t1 = hh + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + sha256_k[t] + w[t];
        unsigned int t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += hh;
    wipe(w, sizeof w); /* the message schedule of a key block is key material */
}

static void sha256_init(struct sha256 *s)
{
    static const unsigned int h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                       0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19}; /* 5.3.3 */
    memcpy(s->h, h0, sizeof h0);
    s->used = 0;
    s->bytes = 0;
}

static void sha256_update(struct sha256 *s, const void *data, size_t n)
{
    const unsigned char *p = data;
    s->bytes += n;
    while (n > 0) {
        size_t take = 64 - s->used < n ? 64 - s->used : n;
        memcpy(s->block + s->used, p, take);
        s->used += take;
        p += take;
        n -= take;
        if (s->used == 64) {
            sha256_block(s->h, s->block);
            s->used = 0;
        }
    }
}

/* Section 5.1.1: a 1 bit, zeros up to 56 bytes into a block, the length in bits (64-bit big-endian). */
static void sha256_final(struct sha256 *s, unsigned char out[32])
{
    unsigned long long bits = s->bytes * 8;
    s->block[s->used++] = 0x80;
    if (s->used > 56) {
        memset(s->block + s->used, 0, 64 - s->used);
        sha256_block(s->h, s->block);
        s->used = 0;
    }
    memset(s->block + s->used, 0, 56 - s->used);
    for (int k = 0; k < 8; k++)
        s->block[56 + k] = (unsigned char)(bits >> (56 - 8 * k));
    sha256_block(s->h, s->block);
    for (int k = 0; k < 32; k++)
        out[k] = (unsigned char)(s->h[k / 4] >> (24 - 8 * (k % 4)));
    wipe(s, sizeof *s);
}

/* HMAC keeps only the two hash states after absorbing K^ipad and K^opad: the key itself is not
 * kept, and each MAC costs the message's blocks plus two. */
struct hmac {
    struct sha256 inner, outer;
};

static void hmac_init(struct hmac *m, const unsigned char *key, size_t n)
{
    unsigned char block[64], hashed[32];
    memset(block, 0, sizeof block);
    if (n > sizeof block) { /* RFC 2104: a key longer than a block is hashed first */
        struct sha256 s;
        sha256_init(&s);
        sha256_update(&s, key, n);
        sha256_final(&s, hashed);
        key = hashed;
        n = sizeof hashed;
    }
    memcpy(block, key, n);
    for (int k = 0; k < 64; k++)
        block[k] ^= 0x36;
    sha256_init(&m->inner);
    sha256_update(&m->inner, block, sizeof block);
    for (int k = 0; k < 64; k++)
        block[k] ^= 0x36 ^ 0x5c;
    sha256_init(&m->outer);
    sha256_update(&m->outer, block, sizeof block);
    wipe(block, sizeof block);
    wipe(hashed, sizeof hashed);
}

/* The MAC of DATA as 64 lowercase hex digits (no terminator); M is left as it was. */
static void hmac_hex(const struct hmac *m, const void *data, size_t n, char hex[64])
{
    struct sha256 s = m->inner;
    unsigned char digest[32];
    sha256_update(&s, data, n);
    sha256_final(&s, digest);
    s = m->outer;
    sha256_update(&s, digest, sizeof digest);
    sha256_final(&s, digest);
    for (int k = 0; k < 32; k++) {
        hex[2 * k] = "0123456789abcdef"[digest[k] >> 4];
        hex[2 * k + 1] = "0123456789abcdef"[digest[k] & 15];
    }
}

struct proc_entry {
    int pid;
    int ppid;
    char state;
};

/* Everything a scan needs, allocated up front. */
static struct proc_entry table[TABLE_CAP];
static int queue[TABLE_CAP];
static struct {
    int pid;
    unsigned gen;
} memo[MEMO_SLOTS];
static unsigned memo_gen;
static char dents[32768] __attribute__((aligned(16)));
static int tids[4096];
static int have_children_files; /* /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN) */

static int status_fd = -1;
static int control_fd = -1;
static int sig_fd = -1;
static int proc_fd = -1;
static pid_t self_pid;
static pid_t child_pid = -1;
static int use_pidfd = 1;
static int want_term, want_kill; /* kill requests not yet served */

/* --detach: records are signed lines appended to a file (status_fd) that the command can write too. */
static int detach_mode;
static struct hmac record_key;          /* the HMAC states under the harness's key; the key is wiped */
static unsigned long long record_seq;   /* SEQ of the next record */
static unsigned long long records_lost; /* not written (a full file system) since the last report */
static int ready_fd = -1; /* until the detached supervisor is ready: where die() sends its reason */
/* --cap-bytes: the relays of stdout and stderr into their files (see the top comment). */
#define RELAY_WAIT_MS 10
static long long cap_bytes = -1;
static long long relay_cap[2];
static char *cap_path;
static int relay_pipe[2] = {-1, -1}; /* read ends of the command's stdout and stderr, -1 at EOF */
static int relay_file[2] = {-1, -1};
static int relay_drop[2];            /* read and dropped from now on */

/* --frame: what goes out on fd 1, framed, in a ring (never more than RING_CAP bytes in memory). */
static int frame_mode;
static int spec_mode; /* --spec: the PROGRAM comes in an 'x' frame on fd 0 */
static unsigned char ring[RING_CAP];
static size_t ring_head, ring_len;
static int out_dead;       /* writing fd 1 failed: nobody reads, output is dropped from now on */
static int harness_left;   /* fd 0 ended or fd 1 failed */
static int requests_open;  /* fd 0 is still read */
struct stream {
    int fd;                /* the supervisor's read end of the command's pipe, -1 once at EOF */
    char type;
    long long budget;      /* once no child is left: bytes still to read (what the pipe held then) */
};
static struct stream streams[2] = {{-1, 'o', 0}, {-1, 'e', 0}};
static int stdin_fd = -1;  /* the supervisor's write end of the command's stdin */
static int stdin_closing;  /* 'c' came: close once the queue is written */
static unsigned char *stdin_queue;
static size_t stdin_head, stdin_len, stdin_cap;
static unsigned long long stdin_written;  /* 'i' bytes written into the command's stdin so far */
static unsigned long long stdin_reported; /* the count the last `input drained` record gave */
static int stdin_broken;                  /* `input broken` was sent: no more input records */
/* `input waiting` / `input busy`: the command's input as stat(2) shows it, taken once at spawn (a pipe:
 * st_dev and st_ino of our write end; a terminal: st_rdev of its slave), and the last state sent. */
static int input_is_terminal;
static dev_t input_dev;
static ino_t input_ino;
static int input_known;      /* the identity was taken: sampling can tell */
static int input_waiting = -1; /* -1 nothing sent yet; else the state the last record gave */
static unsigned long long input_waiting_count; /* and its N */
static long long next_sample;
static unsigned char request[READ_SIZE];
static unsigned char request_header[FRAME_HEADER];
static size_t request_header_len;
static unsigned char request_type;
static size_t request_left; /* payload bytes of the current request frame still to come */
/* The side pipe ('P', 'G'): frames move from fd 1 to a pipe the harness opened itself. */
static int side_pipe[2] = {-1, -1};
static int side_switched;     /* frames after the `switch` record go to side_pipe[1] */
static size_t side_fd1_left;  /* ring bytes still owed to fd 1 (up to and with `switch`) */
static unsigned char side_nonce[64];
static size_t side_nonce_len;
/* --tty / the 'x' payload's terminal field: the command runs on a pseudo-terminal whose master only
 * the supervisor holds (stdin_fd and streams[0].fd are dups of it; the slave is the command's alone). */
static unsigned short tty_rows, tty_cols; /* 0: no terminal */
static int pty_master = -1;
static unsigned char resize_text[32];     /* a 'W' payload: "R C" */
static size_t resize_len;                 /* its length, counted past the buffer too */

/* --status-fd: records wait here until the supervisor is about to block (or exit), so that those of
 * one moment (`exit` and `empty`, most often) reach the harness in one write and wake it once. */
static char status_out[4096];
static size_t status_out_len;
/* --fork-server: the supervisor's pid and a pidfd of it go with the first records it sends. */
static int answer_pidfd = -1;
static pid_t answer_pid;

static void flush_status(void);
static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if (n > (int)sizeof buf - 2)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    flush_status();
    if (ready_fd >= 0) {
        /* --detach, not ready yet: the waiting parent says it on the harness's stderr and exits 125. */
        if (write(ready_fd, buf, (size_t)n) < 0) {
            /* the parent sees EOF and says the supervisor failed */
        }
        exit(EXIT_SETUP);
    }
    if (write(2, "dsh-supervise: ", 15) < 0 || write(2, buf, (size_t)n) < 0) {
        /* nothing left to tell */
    }
    exit(EXIT_SETUP);
}

/* ---- --frame output ---------------------------------------------------------------------------- */

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
static int frame_out(char type, const void *data, size_t n, size_t limit)
{
    if (out_dead || ring_len + FRAME_HEADER + n > limit)
        return 0;
    put_header(ring_len, type, n);
    if (n > 0)
        ring_put(ring_len + FRAME_HEADER, data, n);
    ring_len += FRAME_HEADER + n;
    return 1;
}

/* Writes fd 1 until it would block. An error there means nobody reads: the harness is gone. */
static void harness_gone(void);
/* Where the next ring byte goes: fd 1, or the side pipe once everything owed to fd 1 went out. */
static int out_fd(void)
{
    return side_switched && side_fd1_left == 0 ? side_pipe[1] : 1;
}

static void flush_out(void)
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
static int read_stream(struct stream *s, size_t max)
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

/* Output already written when the PROGRAM process ended belongs before its exit record. Bounded by
 * the ring: a leftover that writes for ever cannot hold the record back. */
static void drain_ready(void)
{
    for (int k = 0; k < 2; k++)
        while (streams[k].fd >= 0 && ring_len < OUT_LIMIT && read_stream(&streams[k], READ_SIZE) > 0) {
        }
}

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

/* One status record: one line, one write(2) (in frame mode: one 's' frame; with --detach: one signed
 * line). Failures (a reader that left, a full file system) are ignored. */
/* One sendmsg(2) of IOV on FD, with PASSFD attached (SCM_RIGHTS) when it is >= 0. */
static ssize_t send_with_fd(int fd, struct iovec *iov, int iovcnt, int passfd, int flags)
{
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)iovcnt;
    if (passfd >= 0) {
        memset(&control, 0, sizeof control);
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof control.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &passfd, sizeof(int));
    }
    return sendmsg(fd, &msg, flags);
}

static void flush_status(void)
{
    if (status_fd < 0 || (status_out_len == 0 && answer_pid == 0))
        return;
    char head[32] = "";
    size_t head_len = 0;
    if (answer_pid != 0) {
        head_len = (size_t)snprintf(head, sizeof head, "pidfd %d\n", (int)answer_pid);
        answer_pid = 0;
    }
    struct iovec iov[2] = {{head, head_len}, {status_out, status_out_len}};
    size_t left = head_len + status_out_len;
    while (left > 0) {
        ssize_t w = answer_pidfd >= 0 ? send_with_fd(status_fd, iov, 2, answer_pidfd, MSG_NOSIGNAL)
                                      : writev(status_fd, iov, 2);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break; /* nobody reads any more: what is left is dropped */
        if (answer_pidfd >= 0) {
            close(answer_pidfd); /* it went with the first bytes */
            answer_pidfd = -1;
        }
        left -= (size_t)w;
        /* Skip what went out (rarely anything is left: a status socket holds far more). */
        for (size_t k = 0; k < 2 && w > 0; k++) {
            size_t take = (size_t)w < iov[k].iov_len ? (size_t)w : iov[k].iov_len;
            iov[k].iov_base = (char *)iov[k].iov_base + take;
            iov[k].iov_len -= take;
            w -= (ssize_t)take;
        }
    }
    status_out_len = 0;
}

static void record(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void record(const char *fmt, ...)
{
    char buf[128];
    va_list ap;
    int fd = status_fd;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if (n > (int)sizeof buf - 2)
        n = (int)sizeof buf - 2;
    if (detach_mode) {
        /* The harness learns that records are missing (and how many) with the next one written. */
        if (records_lost > 0) {
            char note[48];
            int k = snprintf(note, sizeof note, "warning dropped %llu", records_lost);
            if (signed_write(note, (size_t)k) == 0)
                records_lost = 0;
        }
        if (signed_write(buf, (size_t)n) < 0)
            records_lost++;
        return;
    }
    if (frame_mode) {
        /* A command can provoke these without end (SIGUSR1 to its parent, a lowered RLIMIT_NOFILE);
         * while the harness does not read, they must not grow the buffer, nor crowd out the rest. */
        int droppable = strncmp(buf, "signalled ", 10) == 0 || strncmp(buf, "warning ", 8) == 0;
        frame_out('s', buf, (size_t)n, droppable ? RING_CAP - FINAL_ROOM : RING_CAP);
        return;
    }
    buf[n++] = '\n';
    if (fd >= 0) {
        if (status_out_len + (size_t)n > sizeof status_out)
            flush_status();
        memcpy(status_out + status_out_len, buf, (size_t)n);
        status_out_len += (size_t)n;
        return;
    }
    if (fd < 0)
        fd = 2; /* only warnings are worth saying without a status fd */
    if (fd == 2 && strncmp(buf, "warning ", 8) != 0)
        return;
    ssize_t w;
    do
        w = write(fd, buf, (size_t)n);
    while (w < 0 && errno == EINTR);
}

/* ---- --frame input ----------------------------------------------------------------------------- */

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
    if (!frame_out('s', buf, (size_t)n, RING_CAP - FINAL_ROOM) && !out_dead)
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

/* 'P': make the side pipe and say where its read end is (`pipe FD INODE`), so that a harness that
 * may open this process's fds (through /proc/PID/fd/FD: root, or the owner of a user namespace; a
 * same-user command may not, this process being non-dumpable) can read the frames from it instead
 * of fd 1, past whatever relays fd 1 (a container engine copies every byte twice more). Once only;
 * nothing changes until 'G'. */
static void side_offer(void)
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
static void side_switch(void)
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
    char text[8 + 2 * sizeof side_nonce] = "nonce ";
    size_t n = 6;
    static const char hex[] = "0123456789abcdef";
    for (size_t k = 0; k < side_nonce_len; k++) {
        text[n++] = hex[side_nonce[k] >> 4];
        text[n++] = hex[side_nonce[k] & 15];
    }
    frame_out('s', text, n, RING_CAP);
}

/* "R<SEP>C" in N bytes: two decimal numbers of 1 to 65535 (what a struct winsize holds), nothing else.
 * 0 when sound. */
static int parse_size(const char *s, size_t n, char sep, unsigned short *rows, unsigned short *cols)
{
    unsigned long v[2] = {0, 0};
    int k = 0;
    size_t digits = 0;
    for (size_t at = 0; at < n; at++) {
        if (s[at] >= '0' && s[at] <= '9' && digits < 5) {
            v[k] = v[k] * 10 + (unsigned long)(s[at] - '0');
            digits++;
        } else if (s[at] == sep && k == 0 && digits > 0) {
            k = 1;
            digits = 0;
        } else {
            return -1;
        }
    }
    if (k != 1 || digits == 0 || v[0] < 1 || v[0] > 65535 || v[1] < 1 || v[1] > 65535)
        return -1;
    *rows = (unsigned short)v[0];
    *cols = (unsigned short)v[1];
    return 0;
}

/* 'W' "R C": the terminal's new size. The kernel sends SIGWINCH to its foreground process group, as
 * a terminal emulator's resize does. Without a terminal there is nothing to resize; a payload that
 * is not a size changes nothing either (`warning resize 22`). */
static void resize_terminal(void)
{
    unsigned short rows, cols;
    if (pty_master < 0)
        return;
    if (resize_len > sizeof resize_text ||
        parse_size((const char *)resize_text, resize_len, ' ', &rows, &cols) != 0) {
        record("warning resize %d", EINVAL);
        return;
    }
    struct winsize ws = {rows, cols, 0, 0};
    if (ioctl(pty_master, TIOCSWINSZ, &ws) < 0)
        record("warning resize %d", errno);
}

/* Makes the pseudo-terminal (master here, close-on-exec, never our controlling terminal) of the asked
 * size and names its slave, which only the child opens. Returns 0, or the errno that failed it. */
static int open_terminal(char *slave, size_t size)
{
    int fd = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    struct winsize ws = {tty_rows, tty_cols, 0, 0};
    int err = 0;
    if (grantpt(fd) < 0 || unlockpt(fd) < 0 || ioctl(fd, TIOCSWINSZ, &ws) < 0)
        err = errno;
    else
        err = ptsname_r(fd, slave, size);
    /* Three descriptors of one open file: the 'i' queue and the output stream close on their own
     * (input broken, EOF), while 'W' still needs one. */
    if (err == 0 && ((stdin_fd = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0 ||
                     (streams[0].fd = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0))
        err = errno;
    if (err != 0) {
        if (stdin_fd >= 0)
            close(stdin_fd);
        close(fd);
        stdin_fd = streams[0].fd = -1;
        return err;
    }
    pty_master = fd;
    return 0;
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
                side_switch();
            else if (request_left == 0 && request_type == 'W')
                resize_terminal();
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
                side_switch();
        } else if (request_type == 'W') {
            resize_len = 0;
            if (request_left == 0)
                resize_terminal();
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
    for (int k = 0; k < 2; k++) {
        struct stream *s = &streams[k];
        while (s->fd >= 0) {
            if (ring_len >= OUT_LIMIT)
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

static int parse_fd(const char *s, const char *opt)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *s == '\0' || *end != '\0' || v < 3 || v > 1000000)
        die("%s wants a file descriptor number of 3 or more, not '%s'", opt, s);
    if (fcntl((int)v, F_GETFD) < 0)
        die("%s %ld: not an open file descriptor", opt, v);
    if (fcntl((int)v, F_SETFD, FD_CLOEXEC) < 0)
        die("%s %ld: cannot set close-on-exec: %s", opt, v, strerror(errno));
    return (int)v;
}

/* ---- /proc ------------------------------------------------------------------------------------ */

enum { STAT_OK = 0, STAT_GONE = -1, STAT_NOFD = -2 };

static int no_fd_errno(int e)
{
    return e == EMFILE || e == ENFILE || e == ENOMEM;
}

/* Reads the state and ppid of PID from /proc/PID/stat with one new fd (closed before returning); its
 * controlling terminal goes to stat_tty (tty_nr, the kernel's encoding of a device number). */
static unsigned stat_tty;
static int read_stat(int pid, int *ppid, char *state)
{
    char path[32], buf[256];
    snprintf(path, sizeof path, "%d/stat", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return no_fd_errno(errno) ? STAT_NOFD : STAT_GONE;
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    int e = errno;
    close(fd);
    if (n <= 0)
        return (n < 0 && no_fd_errno(e)) ? STAT_NOFD : STAT_GONE;
    buf[n] = '\0';
    /* "PID (COMM) S PPID ...": COMM may hold anything, so look for the last ')'. */
    char *p = memrchr(buf, ')', (size_t)n);
    if (!p || p[1] != ' ' || p[2] == '\0' || p[3] != ' ')
        return STAT_GONE;
    char *end;
    long v = strtol(p + 4, &end, 10);
    if (end == p + 4 || *end != ' ')
        return STAT_GONE;
    *state = p[2];
    *ppid = (int)v;
    /* Then pgrp, session and tty_nr: the controlling terminal (0: none). */
    stat_tty = 0;
    for (int k = 0; k < 3 && *end == ' '; k++) {
        char *field = end + 1;
        v = strtol(field, &end, 10);
        if (end == field)
            break;
        if (k == 2)
            stat_tty = (unsigned)v;
    }
    return STAT_OK;
}

static int by_ppid(const void *a, const void *b)
{
    const struct proc_entry *x = a, *y = b;
    return (x->ppid > y->ppid) - (x->ppid < y->ppid);
}

/* Fills table[] from /proc; returns the number of entries. *incomplete is set when a process could
 * not be read for want of a file descriptor or the table is full (the caller retries later). */
static int scan(int *incomplete, int *err)
{
    int count = 0;
    if (lseek(proc_fd, 0, SEEK_SET) < 0) {
        *incomplete = 1;
        *err = errno;
        return 0;
    }
    for (;;) {
        long n = syscall(SYS_getdents64, proc_fd, dents, sizeof dents);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            *incomplete = 1;
            *err = errno;
            break;
        }
        if (n == 0)
            break;
        for (long off = 0; off < n;) {
            /* struct linux_dirent64: ino (8), off (8), reclen (2), type (1), name */
            unsigned short reclen;
            memcpy(&reclen, dents + off + 16, sizeof reclen);
            const char *name = dents + off + 19;
            off += reclen;
            if (name[0] < '1' || name[0] > '9')
                continue;
            long pid = 0;
            const char *c = name;
            while (*c >= '0' && *c <= '9' && pid < 1L << 30)
                pid = pid * 10 + (*c++ - '0');
            if (*c != '\0')
                continue;
            if (count == TABLE_CAP) {
                *incomplete = 1;
                *err = ENOSPC;
                continue;
            }
            int ppid;
            char state;
            int r = read_stat((int)pid, &ppid, &state);
            if (r == STAT_NOFD) {
                *incomplete = 1;
                *err = errno;
                continue;
            }
            if (r != STAT_OK)
                continue; /* gone since the listing */
            table[count].pid = (int)pid;
            table[count].ppid = ppid;
            table[count].state = state;
            count++;
        }
    }
    return count;
}

static void memo_next_pass(void)
{
    if (++memo_gen == 0) {
        memset(memo, 0, sizeof memo);
        memo_gen = 1;
    }
}

static void memo_add(int pid)
{
    unsigned h = ((unsigned)pid * 2654435761u) & (MEMO_SLOTS - 1);
    for (unsigned i = 0; i < MEMO_SLOTS; i++, h = (h + 1) & (MEMO_SLOTS - 1)) {
        if (memo[h].gen != memo_gen || memo[h].pid == pid) {
            memo[h].pid = pid;
            memo[h].gen = memo_gen;
            return;
        }
    }
}

static int memo_has(int pid)
{
    unsigned h = ((unsigned)pid * 2654435761u) & (MEMO_SLOTS - 1);
    for (unsigned i = 0; i < MEMO_SLOTS; i++, h = (h + 1) & (MEMO_SLOTS - 1)) {
        if (memo[h].gen != memo_gen)
            return 0;
        if (memo[h].pid == pid)
            return 1;
    }
    return 0;
}

/* Is PID (read afresh) still a live descendant? Walks the ppid chain up to the supervisor, or to a
 * process already confirmed as a descendant in this pass. 1 yes, 0 no, STAT_NOFD retry later. */
static int still_ours(int pid)
{
    int cur = pid;
    for (int hops = 0; hops < CHAIN_MAX; hops++) {
        int ppid;
        char state;
        int r = read_stat(cur, &ppid, &state);
        if (r == STAT_NOFD)
            return STAT_NOFD;
        if (r != STAT_OK)
            return 0;
        if (cur == pid && (state == 'Z' || state == 'X'))
            return 0;
        if (ppid == self_pid)
            return 1;
        if (ppid <= 1)
            return 0;
        if (memo_has(ppid))
            return 1;
        cur = ppid;
    }
    return 0;
}

/* Signals PID if it is still ours: 1 signalled, 0 not (gone, not ours), STAT_NOFD retry later.
 * The pidfd pins the process first, so a pid recycled after the check is never signalled. */
static int signal_one(int pid, int sig)
{
    int pfd = -1;
    if (use_pidfd) {
        pfd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (pfd < 0) {
            if (errno == ESRCH)
                return 0;
            if (no_fd_errno(errno))
                return STAT_NOFD;
            if (errno == ENOSYS || errno == EPERM) /* old kernel, or a seccomp filter */
                use_pidfd = 0;
            else
                return 0;
        }
    }
    int ours = still_ours(pid);
    int done = 0;
    if (ours == 1) {
        memo_add(pid);
        if (pfd >= 0)
            done = syscall(SYS_pidfd_send_signal, pfd, sig, NULL, 0) == 0;
        else
            done = kill(pid, sig) == 0;
        if (done && sig == SIGTERM) {
            /* A stopped process would only see SIGTERM once continued. */
            if (pfd >= 0)
                syscall(SYS_pidfd_send_signal, pfd, SIGCONT, NULL, 0);
            else
                kill(pid, SIGCONT);
        }
    }
    if (pfd >= 0)
        close(pfd);
    return ours == STAT_NOFD ? STAT_NOFD : done;
}

/* Signals CHILD (found in a children file) unless this pass handled it already; queues it when ours. */
static int consider(int child, int sig, int *tail, int *signalled, int *alive)
{
    if (child <= 0 || memo_has(child))
        return 0;
    int r = signal_one(child, sig);
    if (r == STAT_NOFD)
        return STAT_NOFD;
    if (memo_has(child)) { /* still ours: signal_one remembered it */
        *signalled += r;
        (*alive)++;
        if (*tail < TABLE_CAP)
            queue[(*tail)++] = child;
    }
    return 0;
}

/* Lists the threads of PID into tids[] (*ntids of them). Returns 0, or STAT_NOFD for want of a file
 * descriptor, or -1 when PID is gone. */
static int read_tids(int pid, int *ntids)
{
    char path[32];
    snprintf(path, sizeof path, "%d/task", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return no_fd_errno(errno) ? STAT_NOFD : -1;
    for (;;) {
        long n = syscall(SYS_getdents64, fd, dents, sizeof dents);
        if (n <= 0)
            break;
        for (long off = 0; off < n;) {
            unsigned short reclen;
            memcpy(&reclen, dents + off + 16, sizeof reclen);
            const char *name = dents + off + 19;
            off += reclen;
            long tid = strtol(name, NULL, 10);
            if (tid > 0 && *ntids < (int)(sizeof tids / sizeof tids[0]))
                tids[(*ntids)++] = (int)tid;
        }
    }
    close(fd);
    return 0;
}

/* Signals the children of PID listed in /proc/PID/task/TID/children as they are read, appending the
 * ones still ours to queue[] (from *tail). One fd at a time. Adds to *signalled and *alive; returns
 * STAT_NOFD when something could not be opened for want of a file descriptor, else 0. */
static int walk_children(int pid, int sig, int *tail, int *signalled, int *alive)
{
    char path[64];
    int ntids = 0, result = 0;
    int fd = read_tids(pid, &ntids);
    if (fd < 0)
        return fd == STAT_NOFD ? STAT_NOFD : 0;
    for (int t = 0; t < ntids; t++) {
        snprintf(path, sizeof path, "%d/task/%d/children", pid, tids[t]);
        fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            if (no_fd_errno(errno))
                result = STAT_NOFD;
            continue;
        }
        char buf[4096];
        long child = 0;
        ssize_t n;
        while ((n = read(fd, buf, sizeof buf)) > 0) {
            for (ssize_t k = 0; k < n; k++) {
                if (buf[k] >= '0' && buf[k] <= '9') {
                    child = child * 10 + (buf[k] - '0');
                    continue;
                }
                if (consider((int)child, sig, tail, signalled, alive) == STAT_NOFD)
                    result = STAT_NOFD;
                child = 0;
            }
        }
        if (consider((int)child, sig, tail, signalled, alive) == STAT_NOFD)
            result = STAT_NOFD;
        close(fd);
    }
    return result;
}

/* One signal pass over the whole subtree. First a walk down the /proc/PID/task/TID/children files
 * from the supervisor (cost: the subtree), signalling each process as it is found, so a chain of
 * short-lived forks cannot outrun it; then a scan of every /proc/PID/stat for the ppid map (cost:
 * the whole system), which finds whatever the children files missed. A process is signalled once
 * per pass. Returns how many were signalled; *alive is the number of live descendants found, plus
 * one if something could not be read (so a SIGKILL loop goes on). */
static int kill_pass(int sig, int *alive)
{
    int incomplete = 0, err = 0, signalled = 0;
    *alive = 0;
    memo_next_pass();
    memo_add(self_pid);
    /* Walk again while a walk finds new processes: the child a process forked just before it was
     * killed re-parents to the supervisor, and the next walk, microseconds later, finds it. */
    for (int round = 0; have_children_files && round < WALK_ROUNDS; round++) {
        int head = 0, tail = 0, found = 0;
        queue[tail++] = self_pid;
        while (head < tail) {
            if (walk_children(queue[head++], sig, &tail, &signalled, &found) == STAT_NOFD) {
                incomplete = 1;
                err = EMFILE;
            }
        }
        *alive += found;
        if (found == 0)
            break;
    }
    int n = scan(&incomplete, &err);
    if (incomplete && no_fd_errno(err)) {
        /* Someone may have lowered our RLIMIT_NOFILE (prlimit works across same-user processes). */
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
            rl.rlim_cur = rl.rlim_max;
            setrlimit(RLIMIT_NOFILE, &rl);
        }
    }
    qsort(table, (size_t)n, sizeof table[0], by_ppid);
    int head = 0, tail = 0;
    queue[tail++] = self_pid;
    while (head < tail) {
        int parent = queue[head++];
        int lo = 0, hi = n;
        while (lo < hi) { /* first entry with ppid >= parent */
            int mid = lo + (hi - lo) / 2;
            if (table[mid].ppid < parent)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (int i = lo; i < n && table[i].ppid == parent && tail < TABLE_CAP; i++) {
            if (table[i].state != 'Z' && table[i].state != 'X' && table[i].pid != self_pid)
                queue[tail++] = table[i].pid;
        }
    }
    for (int i = 1; i < tail; i++) { /* breadth first: parents before their children */
        if (memo_has(queue[i]))
            continue; /* signalled (or found ours) by the walk already */
        int r = signal_one(queue[i], sig);
        if (r == STAT_NOFD) {
            incomplete = 1;
            err = EMFILE;
        } else if (memo_has(queue[i])) {
            signalled += r;
            (*alive)++;
        }
    }
    if (incomplete)
        record("warning proc-scan %d", err);
    if (incomplete)
        (*alive)++;
    return signalled;
}

/* ---- --frame: is the command waiting for input? ---------------------------------------------- */

static long long now_ms(void);

#define SAMPLE_MS 200  /* between two looks at the subtree while the input is open */
#define SAMPLE_MAX 256 /* processes looked at in one: a bound on the cost of a look */

/* The system calls a reader of the input blocks in: read(2)'s kin with the fd as arg0, and select(2)'s
 * kin, which is taken as a read of fd 0 only with nfds 1 and neither write nor except sets. */
#if defined(__x86_64__)
static const long read_calls[] = {0, 19, 17}; /* read, readv, pread64 */
static const long select_calls[] = {23, 270}; /* select, pselect6 */
#elif defined(__aarch64__)
static const long read_calls[] = {63, 65, 67};
static const long select_calls[] = {72};
#else
static const long read_calls[] = {-2};
static const long select_calls[] = {-2};
#endif

static int in_calls(long nr, const long *calls, size_t n)
{
    for (size_t k = 0; k < n; k++)
        if (calls[k] == nr)
            return 1;
    return 0;
}

/* The fd PID is blocked reading at this moment (state S, in one of the calls above), else -1. */
static int blocked_read_fd(int pid)
{
    int ppid;
    char state;
    if (read_stat(pid, &ppid, &state) != STAT_OK || state != 'S')
        return -1;
    char path[32], buf[256];
    snprintf(path, sizeof path, "%d/syscall", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return -1; /* gone, or not ours to look at: never reported */
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    /* "NR ARG0 ... ARG5 SP PC" (NR decimal, the rest hex), or "running", or "-1 SP PC". */
    if (buf[0] < '0' || buf[0] > '9')
        return -1;
    char *p = buf, *end;
    long nr = strtol(p, &end, 10);
    unsigned long long args[4];
    p = end;
    for (int k = 0; k < 4; k++) {
        if (*p != ' ')
            return -1;
        args[k] = strtoull(p + 1, &end, 16);
        if (end == p + 1)
            return -1;
        p = end;
    }
    if (in_calls(nr, read_calls, sizeof read_calls / sizeof read_calls[0]))
        return args[0] <= 0x7fffffff ? (int)args[0] : -1;
    if (in_calls(nr, select_calls, sizeof select_calls / sizeof select_calls[0]) && args[0] == 1 &&
        args[2] == 0 && args[3] == 0)
        return 0;
    return -1;
}

/* Whether /proc/PID/fd/FD is the command's input: the pipe, or the terminal (any fd opened on it,
 * /dev/tty too, has its device number). */
static int is_input(int pid, int fd)
{
    char path[48];
    struct stat st;
    snprintf(path, sizeof path, "%d/fd/%d", pid, fd);
    if (fstatat(proc_fd, path, &st, 0) < 0)
        return 0;
    /* An fd opened on /dev/tty is that device's (5, 0), whatever terminal it reaches: the caller's
     * controlling one, which read_stat just gave for this process. tty_nr is encoded as
     * new_encode_dev(): minor's low byte, the major from bit 8, the minor's rest from bit 20. */
    unsigned major_ = major(input_dev), minor_ = minor(input_dev);
    unsigned input_tty = (minor_ & 0xff) | (major_ << 8) | ((minor_ & ~0xffu) << 12);
    if (input_is_terminal)
        return st.st_rdev != 0 &&
               (st.st_rdev == input_dev || (st.st_rdev == makedev(5, 0) && stat_tty == input_tty));
    return st.st_dev == input_dev && st.st_ino == input_ino;
}

/* One look down the subtree from the supervisor (the children files, as a kill pass walks them, but
 * nothing is signalled): 1 when some process is blocked reading the input. A process that forks or
 * ends meanwhile may be missed; the harness asks for two looks in a row. */
static int input_waiter(void)
{
    int queue[SAMPLE_MAX];
    int head = 0, tail = 0;
    queue[tail++] = self_pid;
    while (head < tail) {
        int pid = queue[head++];
        if (pid != self_pid) {
            int fd = blocked_read_fd(pid);
            if (fd >= 0 && is_input(pid, fd))
                return 1;
        }
        int ntids = 0;
        if (tail >= SAMPLE_MAX || read_tids(pid, &ntids) < 0)
            continue;
        for (int t = 0; t < ntids && tail < SAMPLE_MAX; t++) {
            char path[64], buf[4096];
            snprintf(path, sizeof path, "%d/task/%d/children", pid, tids[t]);
            int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
            if (fd < 0)
                continue;
            long child = 0;
            ssize_t n;
            while (tail < SAMPLE_MAX && (n = read(fd, buf, sizeof buf)) > 0) {
                for (ssize_t k = 0; k < n && tail < SAMPLE_MAX; k++) {
                    if (buf[k] >= '0' && buf[k] <= '9') {
                        child = child * 10 + (buf[k] - '0');
                        continue;
                    }
                    if (child > 0)
                        queue[tail++] = (int)child;
                    child = 0;
                }
            }
            if (child > 0 && tail < SAMPLE_MAX)
                queue[tail++] = (int)child;
            close(fd);
        }
    }
    return 0;
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
    if (!input_is_terminal && ioctl(stdin_fd, FIONREAD, &unread) < 0)
        unread = 0;
    int waiting = stdin_len == 0 && unread == 0 && input_waiter();
    /* A reader that took the new bytes and waits again within one look waits anew: its N changed. */
    if (waiting == input_waiting && (!waiting || stdin_written == input_waiting_count))
        return;
    char buf[48];
    int n = snprintf(buf, sizeof buf, "input %s %llu", waiting ? "waiting" : "busy", stdin_written);
    if (frame_out('s', buf, (size_t)n, RING_CAP - FINAL_ROOM) || out_dead) {
        input_waiting = waiting;
        input_waiting_count = stdin_written;
    }
}

/* ---- children --------------------------------------------------------------------------------- */

/* Reaps every child that has ended; reports the PROGRAM process. Returns 1 when none is left. */
static int reap(void)
{
    for (;;) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG | __WALL);
        if (p > 0) {
            if (p == child_pid) {
                if (frame_mode)
                    drain_ready();
                if (WIFEXITED(st))
                    record("exit %d", WEXITSTATUS(st));
                else if (WIFSIGNALED(st))
                    record("signal %d%s", WTERMSIG(st), WCOREDUMP(st) ? " core" : "");
                child_pid = -1;
            }
            continue;
        }
        if (p == 0)
            return 0;
        if (errno == EINTR)
            continue;
        return errno == ECHILD;
    }
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- --detach ---------------------------------------------------------------------------------- */

/* --cap-bytes: moves what stream K's pipe holds into its file while the file stays within the cap.
 * Returns 1 when the file is full (the pipe is left unread: look again after RELAY_WAIT_MS). */
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

#define KEY_SIZE 32

/* Reads exactly N bytes from FD, waiting on it if it is non-blocking. 0 when all N came. */
static int read_exact(int fd, unsigned char *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r > 0) {
            got += (size_t)r;
        } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            poll(&p, 1, -1);
        } else if (!(r < 0 && errno == EINTR)) {
            return -1;
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

/* Field 22 of /proc/self/stat, the start time in clock ticks since boot: with the pid, it names this
 * process for good (the harness checks both before it signals a pid that may have been reused). */
static unsigned long long own_start_time(void)
{
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("cannot open /proc/self/stat: %s", strerror(errno));
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0)
        die("cannot read /proc/self/stat");
    buf[n] = '\0';
    /* The comm may hold spaces and parentheses: count fields from the last ')'. Field 3 follows its
     * first space, so field 22 follows the 20th. */
    char *p = memrchr(buf, ')', (size_t)n);
    for (int spaces = 0; p != NULL && spaces < 20; spaces++) {
        p = strchr(p, ' ');
        if (p != NULL)
            p++;
    }
    char *end;
    unsigned long long ticks = p != NULL ? strtoull(p, &end, 10) : 0;
    if (p == NULL || end == p)
        die("cannot read the start time in /proc/self/stat");
    return ticks;
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
    /* Out of the harness's session and process group: its hangup, its group's signals and its
     * channel's end are no concern of the supervisor's. */
    if (setsid() < 0)
        die("setsid: %s", strerror(errno));
}

/* Test aids: `--sha256` prints the SHA-256 of stdin, `--hmac-sha256 KEYHEX` its HMAC-SHA256, both in
 * lowercase hex, so that the tests check this code against the standard vectors. */
static int digest_stdin(const char *key_hex)
{
    unsigned char key[256];
    size_t key_len = 0;
    if (key_hex != NULL) {
        size_t n = strlen(key_hex);
        if (n % 2 || n / 2 > sizeof key)
            die("--hmac-sha256 wants an even number of hex digits, at most %zu", 2 * sizeof key);
        for (size_t k = 0; k < n; k += 2) {
            char pair[3] = {key_hex[k], key_hex[k + 1], '\0'}, *end;
            key[key_len++] = (unsigned char)strtoul(pair, &end, 16);
            if (*end != '\0')
                die("--hmac-sha256: not a hex digit in '%s'", key_hex);
        }
    }
    size_t len = 0, cap = 65536;
    unsigned char *data = malloc(cap);
    for (;;) {
        if (data == NULL)
            die("out of memory");
        ssize_t r = read(0, data + len, cap - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            die("read: %s", strerror(errno));
        if (r == 0)
            break;
        len += (size_t)r;
        if (len == cap)
            data = realloc(data, cap *= 2);
    }
    char hex[65];
    if (key_hex != NULL) {
        struct hmac m;
        hmac_init(&m, key, key_len);
        hmac_hex(&m, data, len, hex);
    } else {
        struct sha256 s;
        unsigned char digest[32];
        sha256_init(&s);
        sha256_update(&s, data, len);
        sha256_final(&s, digest);
        for (int k = 0; k < 32; k++)
            snprintf(hex + 2 * k, 3, "%02x", digest[k]);
    }
    hex[64] = '\0';
    printf("%s\n", hex);
    free(data);
    return 0;
}

/* ---- --fork-server ----------------------------------------------------------------------------- */

#define SERVER_REQUEST_MAX (16 << 20) /* argv + environment: far beyond what execve takes */
#define SERVER_FDS 4                   /* status socket, then the command's stdin, stdout, stderr */
#define EXIT_PROTOCOL 126              /* a spare read what no harness of this version sends */
#define SPARE_DELAY_MS 20              /* after a request was taken, at most this long without a spare */
#define SERVER_END_MS 1500             /* at close: how long the server waits for its supervisors */
#define SPARE_RETRY_MS 50              /* after a fork failed for lack of processes or memory */

/* What the child of one request runs, and where: set in the child, used by main's exec. */
static char **program_env;   /* NULL: this process's own environment */
static char *program_cwd;    /* NULL: stay */
/* >= 3: the program gets the status socket as this fd (a launcher that runs a supervisor of its own
 * inside a sandbox, whose records are the command's; this one's follow them). -1: it does not. */
static int program_status_fd = -1;

/* Reads a request's header (with its fds) from the harness's socket: 1 when one came, 0 at EOF, -1
 * when it carried more fds than fit (not a request of this version). NFDS counts every fd sent. */
static int server_header(unsigned *len, int fds[SERVER_FDS], int *nfds)
{
    unsigned char head[4];
    size_t got = 0;
    *nfds = 0;
    while (got < sizeof head) {
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(sizeof(int) * (SERVER_FDS + 4))];
        } control;
        struct iovec iov = {head + got, sizeof head - got};
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof control.buf;
        ssize_t n = recvmsg(0, &msg, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return 0;
        /* One SCM_RIGHTS message is all a request carries (musl's CMSG_NXTHDR does not build
         * warning-free, and nothing else would come here). */
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        if (c != NULL && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            int *in = (int *)(void *)CMSG_DATA(c);
            for (size_t k = 0; k < count; k++) {
                if (*nfds < SERVER_FDS)
                    fds[*nfds] = in[k];
                else
                    close(in[k]); /* more than a request has: not a sound harness, see below */
                (*nfds)++;
            }
        }
        if (msg.msg_flags & MSG_CTRUNC)
            return -1; /* more fds than any request has */
        got += (size_t)n;
    }
    *len = (unsigned)head[0] << 24 | (unsigned)head[1] << 16 | (unsigned)head[2] << 8 | head[3];
    return 1;
}

/* Splits a request's payload (NUL-terminated strings: the working directory, the argument count, the
 * arguments, then the environment) into the globals main runs the command with. 0 when it is sound. */
static int server_parse(char *data, size_t len, char ***argv_out)
{
    if (len == 0 || data[len - 1] != '\0')
        return -1;
    size_t count = 0;
    for (size_t k = 0; k < len; k++)
        count += data[k] == '\0';
    char **strings = calloc(count + 1, sizeof *strings);
    if (strings == NULL)
        return -1;
    char *p = data;
    for (size_t k = 0; k < count; k++) {
        strings[k] = p;
        p += strlen(p) + 1;
    }
    if (count < 4)
        return -1;
    char *end;
    errno = 0;
    long status_to = strtol(strings[1], &end, 10);
    if (errno || *end || status_to < -1 || status_to > 1023 || (status_to >= 0 && status_to <= 2))
        return -1;
    unsigned long argc = strtoul(strings[2], &end, 10);
    if (errno || *end || argc < 1 || argc > count - 3)
        return -1;
    char **argv = calloc(argc + 1, sizeof *argv);
    char **envp = calloc(count - 3 - argc + 1, sizeof *envp);
    if (argv == NULL || envp == NULL)
        return -1;
    memcpy(argv, strings + 3, argc * sizeof *argv);
    memcpy(envp, strings + 3 + argc, (count - 3 - argc) * sizeof *envp);
    program_status_fd = (int)status_to;
    program_cwd = strings[0];
    program_env = envp;
    *argv_out = argv;
    return 0;
}

static void server_answer(int fd, const char *text, int pidfd)
{
    struct iovec iov = {(void *)text, strlen(text)};
    ssize_t w;
    do
        w = send_with_fd(fd, &iov, 1, pidfd, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (w < 0 && errno == EINTR);
}

#define DRAINED_USR2 1

/* Reads every pending signal from the signalfd (the fork server and its spares act on SIGUSR2 alone;
 * SIGCHLD only wakes them). Returns DRAINED_USR2 when SIGUSR2 was among them. */
static int drain_signals(void)
{
    struct signalfd_siginfo si[16];
    ssize_t n;
    int seen = 0;
    while ((n = read(sig_fd, si, sizeof si)) > 0)
        for (size_t k = 0; k < (size_t)n / sizeof si[0]; k++)
            if (si[k].ssi_signo == SIGUSR2)
                seen |= DRAINED_USR2;
    return seen;
}

/* What becomes of this process as a supervisor, done ahead of its command (a spare does it while it
 * waits, off the path of the request it will take): a subreaper; /proc, to find descendants; /dev/null,
 * opened before the spawn so that dropping the command's stdio needs no new fd. A failure is kept, to
 * be reported once a status channel exists. */
static int dev_null = -1;
static int subreaper_errno, proc_errno, dev_null_errno;
static void prepare_supervisor(void)
{
    self_pid = getpid();
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
        subreaper_errno = errno;
    proc_fd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (proc_fd < 0) {
        proc_errno = errno;
    } else {
        char children_path[64];
        snprintf(children_path, sizeof children_path, "%d/task/%d/children", (int)self_pid, (int)self_pid);
        have_children_files = faccessat(proc_fd, children_path, R_OK, 0) == 0;
    }
    dev_null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (dev_null < 0)
        dev_null_errno = errno;
}

/* A spare of the fork server: waits, ready, for the next request on fd 0 and takes it (then tells the
 * server through TAKEN, so that it forks the next spare). Returns the request's program, as that
 * command's supervisor, with status_fd, fds 0-2, and the program's environment and directory set. */
static char **spare(int taken)
{
    pid_t server = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGUSR2, 0, 0, 0) < 0 || getppid() != server)
        _exit(0);
    prepare_supervisor();
    for (;;) {
        struct pollfd pfds[2] = {{0, POLLIN, 0}, {sig_fd, POLLIN, 0}};
        if (poll(pfds, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            die("poll: %s", strerror(errno));
        }
        if ((pfds[1].revents & POLLIN) && drain_signals() & DRAINED_USR2)
            _exit(0); /* the server is gone, so is the harness */
        if (pfds[0].revents & (POLLIN | POLLHUP | POLLERR))
            break;
    }
    unsigned len;
    int fds[SERVER_FDS], nfds;
    int header = server_header(&len, fds, &nfds);
    if (header == 0)
        _exit(0); /* the executor closed */
    if (header < 0)
        _exit(EXIT_PROTOCOL);
    if (nfds != SERVER_FDS || len > SERVER_REQUEST_MAX)
        _exit(EXIT_PROTOCOL); /* not a request this version sent: nothing read from here is sound */
    char *data = malloc(len ? len : 1);
    if (data == NULL || read_exact(0, (unsigned char *)data, len) != 0)
        _exit(EXIT_PROTOCOL);
    char one = 't';
    if (write(taken, &one, 1) != 1)
        _exit(EXIT_SETUP);
    close(taken);
    status_fd = fds[0];
    /* The harness holds this process by a pidfd from the start: no pid it signals can be reused.
     * Both go with the first records (flush_status), so that the harness wakes once for them. */
    answer_pid = getpid();
    answer_pidfd = (int)syscall(SYS_pidfd_open, answer_pid, 0);
    char **argv;
    if (server_parse(data, len, &argv) != 0) {
        record("execfail %d", EINVAL);
        record("exit 127");
        record("empty");
        flush_status();
        _exit(0);
    }
    /* The command's stdio on 0-2 (received fds are >= 3: 0-2 were taken when they came). */
    for (int k = 0; k < 3; k++)
        if (dup2(fds[k + 1], k) < 0)
            die("dup2: %s", strerror(errno));
    for (int k = 1; k < SERVER_FDS; k++)
        close(fds[k]);
    return argv;
}

/* The harness closed the server's socket: every supervisor still running (and the spare) is told to
 * kill its command's processes, and the server stays until they are all gone, so that the harness,
 * which waits for the server to exit, knows that nothing of its commands is left. They all share the
 * server's process group (the harness made it a session leader; each command has a session of its
 * own), so one kill reaches exactly them. SIGCONT first: a supervisor a command stopped would never
 * act. SIGUSR2 is what their PDEATHSIG sends once the server is gone, so past the bound that still
 * happens. */
static void end_server(void) __attribute__((noreturn));
static void end_server(void)
{
    kill(0, SIGCONT);
    kill(0, SIGUSR2);
    long long deadline = now_ms() + SERVER_END_MS;
    for (;;) {
        int st;
        pid_t p;
        while ((p = waitpid(-1, &st, WNOHANG | __WALL)) > 0)
            ;
        if (p < 0 && errno == ECHILD)
            exit(0);
        long long left = deadline - now_ms();
        if (left <= 0)
            exit(0);
        struct pollfd pfd = {sig_fd, POLLIN, 0};
        if (poll(&pfd, 1, (int)left) > 0)
            drain_signals();
    }
}

/* The fork server: one per executor, started once, so that a command costs no exec of a supervisor.
 * It keeps one spare child ready (a fork of itself) that takes the next request from fd 0 (a Unix
 * stream socket) and becomes that command's supervisor; the server forks the next spare once it is
 * told the request was taken. The server never reads fd 0 itself; it ends when the harness closes
 * its end, or dies (--die-with-parent): every child's PDEATHSIG then kills what is left of it.
 * Returns only in a spare that took a request. */
static char **fork_server(void)
{
    if (fcntl(0, F_GETFD) < 0)
        die("--fork-server needs fd 0 open (the harness's socket)");
    int taken[2];
    if (pipe2(taken, O_CLOEXEC) < 0)
        die("pipe2: %s", strerror(errno));
    pid_t spare_pid = -1;
    int spare_failures = 0;
    long long refill_at = 0; /* when to fork the next spare, if nothing calls for it sooner */
    for (;;) {
        if (spare_pid < 0 && now_ms() >= refill_at) {
            spare_pid = fork();
            if (spare_pid == 0) {
                close(taken[0]);
                return spare(taken[1]);
            }
            if (spare_pid < 0 && errno != EAGAIN && errno != ENOMEM)
                die("fork: %s", strerror(errno));
            if (spare_pid < 0) {
                refill_at = now_ms() + SPARE_RETRY_MS; /* out of processes: requests wait meanwhile */
            } else {
                /* So that the harness can continue a spare a command stopped before it sends. */
                int pidfd = (int)syscall(SYS_pidfd_open, spare_pid, 0);
                char note[32];
                snprintf(note, sizeof note, "spare %d\n", (int)spare_pid);
                server_answer(0, note, pidfd);
                if (pidfd >= 0)
                    close(pidfd);
            }
        }
        /* Without a spare, a request waiting on fd 0 calls for one at once. */
        short requests = (short)(POLLRDHUP | (spare_pid < 0 ? POLLIN : 0));
        struct pollfd pfds[3] = {{0, requests, 0}, {taken[0], POLLIN, 0}, {sig_fd, POLLIN, 0}};
        int timeout = -1;
        if (spare_pid < 0) {
            long long left = refill_at - now_ms();
            timeout = left < 0 ? 0 : (int)left;
        }
        if (poll(pfds, 3, timeout) < 0) {
            if (errno == EINTR)
                continue;
            die("poll: %s", strerror(errno));
        }
        if (pfds[0].revents & (POLLRDHUP | POLLHUP | POLLERR))
            end_server();
        if (pfds[0].revents & POLLIN)
            refill_at = 0;
        if (pfds[1].revents & POLLIN) {
            char buf[64];
            if (read(taken[0], buf, sizeof buf) > 0) {
                /* The next spare is forked once this command's supervisor is done, or a little later:
                 * on a small machine, a fork now would take a CPU from the command just starting. */
                spare_pid = -1;
                spare_failures = 0;
                refill_at = now_ms() + SPARE_DELAY_MS;
            }
        }
        if (pfds[2].revents & POLLIN) {
            if (drain_signals() & DRAINED_USR2)
                exit(0);
            int st;
            pid_t p;
            while ((p = waitpid(-1, &st, WNOHANG | __WALL)) > 0) {
                if (p != spare_pid) {
                    refill_at = 0; /* a supervisor is done: the CPU is free for the next spare */
                    continue;
                }
                /* The spare died before it took a request (a command killed it): fork another, but a
                 * spare that fails its own setup would fail every time. */
                spare_pid = -1;
                refill_at = 0;
                if (WIFEXITED(st) && WEXITSTATUS(st) == EXIT_PROTOCOL)
                    die("a request that is not one of this version's: the socket is out of step");
                if (WIFEXITED(st) && WEXITSTATUS(st) == EXIT_SETUP && ++spare_failures >= 3)
                    die("the spare supervisor failed three times in a row");
            }
        }
    }
}

/* A copy of BASE without the variables named in NAMES, then NAME=VALUE for each (a later one wins). */
static char **command_environment(char **base, char **names, char **values, int count)
{
    size_t n = 0;
    while (base[n] != NULL)
        n++;
    if (count == 0)
        return base;
    char **env = calloc(n + (size_t)count + 1, sizeof *env);
    if (env == NULL)
        die("out of memory");
    size_t used = 0;
    for (size_t k = 0; k < n; k++) {
        int replaced = 0;
        for (int j = 0; j < count && !replaced; j++) {
            size_t len = strlen(names[j]);
            replaced = strncmp(base[k], names[j], len) == 0 && base[k][len] == '=';
        }
        if (!replaced)
            env[used++] = base[k];
    }
    for (int j = 0; j < count; j++) {
        int later = 0;
        for (int l = j + 1; l < count && !later; l++)
            later = strcmp(names[j], names[l]) == 0;
        if (later)
            continue;
        size_t size = strlen(names[j]) + strlen(values[j]) + 2;
        char *entry = malloc(size);
        if (entry == NULL)
            die("out of memory");
        snprintf(entry, size, "%s=%s", names[j], values[j]);
        env[used++] = entry;
    }
    return env;
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
static size_t take_terminal_field(char *data, size_t len)
{
    if (len == 0 || data[len - 1] != '\0')
        return len; /* not sound: server_parse says so */
    char *field = data;
    for (int k = 0; k < 2 && field < data + len; k++)
        field += strlen(field) + 1;
    if (field >= data + len)
        return len;
    size_t n = strlen(field);
    if (n > 0 && strspn(field, "0123456789") == n)
        return len; /* an argument count: no terminal field */
    if (strcmp(field, "-") != 0 && parse_size(field, n, ' ', &tty_rows, &tty_cols) != 0)
        die("--spec: not a sound terminal field");
    memmove(field, field + n + 1, (size_t)(data + len - (field + n + 1)));
    return len - (n + 1);
}

/* --spec: waits on fd 0 for the 'x' frame that names the command: NUL-terminated strings as a
 * --fork-server request's payload (a directory, which must be ".", the status fd "-1", the argument
 * count, the arguments, then NAME=VALUE entries applied as --setenv). Frames of other types before
 * it are skipped. EOF first: the spare was not needed; exit 0 without a word. */
static char **read_spec(char ***names_out, char ***values_out, int *count_out)
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
        len = take_terminal_field(data, len);
        char **program = NULL;
        if (server_parse(data, len, &program) != 0 || program_status_fd != -1 || program_cwd == NULL ||
            strcmp(program_cwd, ".") != 0)
            die("--spec: not a sound command frame");
        int count = 0;
        while (program_env[count] != NULL)
            count++;
        char **names = calloc((size_t)count + 1, sizeof *names);
        char **values = calloc((size_t)count + 1, sizeof *values);
        if (names == NULL || values == NULL)
            die("out of memory");
        for (int k = 0; k < count; k++) {
            char *eq = strchr(program_env[k], '=');
            if (eq == NULL || eq == program_env[k])
                die("--spec: an environment entry without NAME=");
            *eq = '\0';
            names[k] = program_env[k];
            values[k] = eq + 1;
        }
        program_env = NULL; /* the entries are --setenv ones: the supervisor's environment is the base */
        program_cwd = NULL;
        *names_out = names;
        *values_out = values;
        *count_out = count;
        return program;
    }
}

static void usage(void) __attribute__((noreturn));
static void usage(void)
{
    die("usage: dsh-supervise [--status-fd N] [--control-fd N] [--die-with-parent] [--allow-no-subreaper] "
        "[--setenv NAME=VALUE]... -- PROGRAM [ARGS...]\n"
        "       dsh-supervise --frame [--tty ROWSxCOLS] [--allow-no-subreaper] [--setenv NAME=VALUE]... -- PROGRAM "
        "[ARGS...]\n"
        "       dsh-supervise --frame --spec [--allow-no-subreaper]\n"
        "       dsh-supervise --detach --status-file PATH [--stdin-file PATH] [--stdout-file PATH] "
        "[--stderr-file PATH] [--allow-no-subreaper] [--setenv NAME=VALUE]... -- PROGRAM [ARGS...]\n"
        "       dsh-supervise --fork-server [--die-with-parent] [--allow-no-subreaper]");
}

int main(int argc, char **argv)
{
    /* First of all: from here on no process of the same user can read this one's memory (the
     * --detach key) or open its fds through /proc, nor ptrace it. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        die("prctl(PR_SET_DUMPABLE): %s", strerror(errno));
    int die_with_parent = 0, allow_no_subreaper = 0, server_mode = 0;
    char *status_path = NULL, *stdio_paths[3] = {NULL, NULL, NULL};
    int stdio_files[3] = {-1, -1, -1};
    /* --setenv: indexes into argv, copied below (before the argument area is cleared). */
    int *setenv_args = calloc((size_t)argc, sizeof *setenv_args);
    int setenv_count = 0;
    if (setenv_args == NULL)
        die("out of memory");
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (strcmp(a, "--status-fd") == 0 && i + 1 < argc) {
            status_fd = parse_fd(argv[++i], a);
        } else if (strcmp(a, "--control-fd") == 0 && i + 1 < argc) {
            control_fd = parse_fd(argv[++i], a);
        } else if (strcmp(a, "--die-with-parent") == 0) {
            die_with_parent = 1;
        } else if (strcmp(a, "--frame") == 0) {
            frame_mode = 1;
        } else if (strcmp(a, "--spec") == 0) {
            spec_mode = 1;
        } else if (strcmp(a, "--tty") == 0 && i + 1 < argc) {
            i++;
            if (parse_size(argv[i], strlen(argv[i]), 'x', &tty_rows, &tty_cols) != 0)
                die("--tty wants ROWSxCOLS, each a number from 1 to 65535");
        } else if (strcmp(a, "--detach") == 0) {
            detach_mode = 1;
        } else if (strcmp(a, "--fork-server") == 0) {
            server_mode = 1;
        } else if (strcmp(a, "--status-file") == 0 && i + 1 < argc) {
            status_path = argv[++i]; /* copied below, before the argument area is cleared */
        } else if (strcmp(a, "--stdin-file") == 0 && i + 1 < argc) {
            stdio_paths[0] = argv[++i];
        } else if (strcmp(a, "--stdout-file") == 0 && i + 1 < argc) {
            stdio_paths[1] = argv[++i];
        } else if (strcmp(a, "--stderr-file") == 0 && i + 1 < argc) {
            stdio_paths[2] = argv[++i];
        } else if (strcmp(a, "--cap-bytes") == 0 && i + 1 < argc) {
            char *end;
            errno = 0;
            cap_bytes = strtoll(argv[++i], &end, 10);
            if (errno != 0 || end == argv[i] || *end != '\0' || cap_bytes < 2 * 4096)
                die("--cap-bytes wants a number of bytes, at least 8192");
            relay_cap[0] = relay_cap[1] = cap_bytes;
        } else if (strcmp(a, "--cap-file") == 0 && i + 1 < argc) {
            cap_path = argv[++i]; /* copied below, before the argument area is cleared */
        } else if (strcmp(a, "--sha256") == 0) {
            return digest_stdin(NULL);
        } else if (strcmp(a, "--hmac-sha256") == 0 && i + 1 < argc) {
            return digest_stdin(argv[i + 1]);
        } else if (strcmp(a, "--allow-no-subreaper") == 0) {
            allow_no_subreaper = 1;
        } else if (strcmp(a, "--setenv") == 0 && i + 1 < argc) {
            /* The argument is not shown: its value may be meant for the command's eyes alone. */
            const char *eq = strchr(argv[++i], '=');
            if (eq == NULL || eq == argv[i])
                die("--setenv wants NAME=VALUE with a non-empty NAME");
            setenv_args[setenv_count++] = i;
        } else if (strcmp(a, "--version") == 0) {
            printf("dsh-supervise " VERSION "\n");
            return 0;
        } else if (a[0] == '-') {
            usage();
        } else {
            break;
        }
    }
    if (server_mode && (frame_mode || detach_mode || status_fd >= 0 || control_fd >= 0 || i < argc))
        die("--fork-server takes its requests from fd 0 and runs the programs they name: it goes with none "
            "of --frame, --detach, --status-fd, --control-fd, nor a PROGRAM");
    if (spec_mode && (!frame_mode || i < argc || setenv_count > 0 || tty_rows > 0))
        die("--spec goes with --frame, and takes the PROGRAM, its --setenv entries and its terminal (no --tty) "
            "from fd 0");
    if (tty_rows > 0 && !frame_mode)
        die("--tty goes with --frame: the supervisor holds the terminal's master and relays it");
    if (i >= argc && !server_mode && !spec_mode)
        usage();
    if (frame_mode && (status_fd >= 0 || control_fd >= 0 || die_with_parent))
        die("--frame takes its requests from fd 0 and writes its records to fd 1: it goes with none of "
            "--status-fd, --control-fd, --die-with-parent");
    if (detach_mode && (frame_mode || status_fd >= 0 || control_fd >= 0 || die_with_parent))
        die("--detach writes its records to --status-file and takes requests as signals: it goes with none "
            "of --frame, --status-fd, --control-fd, --die-with-parent");
    if (detach_mode && status_path == NULL)
        die("--detach needs --status-file PATH");
    if (!detach_mode && (status_path || stdio_paths[0] || stdio_paths[1] || stdio_paths[2]))
        die("--status-file, --stdin-file, --stdout-file and --stderr-file go with --detach only");
    if (cap_bytes >= 0 && (!detach_mode || stdio_paths[1] == NULL || stdio_paths[2] == NULL))
        die("--cap-bytes goes with --detach, --stdout-file and --stderr-file");
    if (cap_path != NULL && cap_bytes < 0)
        die("--cap-file goes with --cap-bytes");
    if (cap_path != NULL && (cap_path = strdup(cap_path)) == NULL)
        die("out of memory");
    if (status_path != NULL && (status_path = strdup(status_path)) == NULL)
        die("out of memory");
    for (int k = 0; k < 3; k++)
        if (stdio_paths[k] != NULL && (stdio_paths[k] = strdup(stdio_paths[k])) == NULL)
            die("out of memory");
    if (frame_mode) {
        if (fcntl(0, F_GETFD) < 0 || fcntl(1, F_GETFD) < 0)
            die("--frame needs fds 0 and 1 open (the harness's stream)");
        /* A closed fd 2 would be handed to one of the command's pipes below, then replaced by
         * /dev/null after the fork. */
        if (fcntl(2, F_GETFD) < 0 && open("/dev/null", O_RDWR) != 2)
            die("cannot open /dev/null as fd 2");
    }
    /* The command (PROGRAM and its arguments, a whole `bash -c COMMAND`) is copied out of the
     * argument area, which is then cleared: /proc/<pid>/cmdline of a supervisor that outlives the
     * command's shell must not read like one of the command's processes to whoever looks for them by
     * their command line (nor show the command's text to `ps` for longer than the command runs). */
    int program_argc = argc - i;
    char **program = calloc((size_t)program_argc + 1, sizeof *program);
    if (program == NULL)
        die("out of memory");
    for (int k = 0; k < program_argc; k++) {
        program[k] = strdup(argv[i + k]);
        if (program[k] == NULL)
            die("out of memory");
    }
    /* NAME and VALUE of each --setenv, for the child alone: the supervisor's own environment stays
     * as it was (nothing marks it as one of the command's processes). */
    char **setenv_names = calloc((size_t)setenv_count + 1, sizeof *setenv_names);
    char **setenv_values = calloc((size_t)setenv_count + 1, sizeof *setenv_values);
    if (setenv_names == NULL || setenv_values == NULL)
        die("out of memory");
    for (int k = 0; k < setenv_count; k++) {
        const char *arg = argv[setenv_args[k]];
        const char *eq = strchr(arg, '=');
        setenv_names[k] = strndup(arg, (size_t)(eq - arg));
        setenv_values[k] = strdup(eq + 1);
        if (setenv_names[k] == NULL || setenv_values[k] == NULL)
            die("out of memory");
    }
    free(setenv_args);
    if (spec_mode) {
        /* A spare started ahead of its command: the command comes now, on fd 0. */
        free(program);
        free(setenv_names);
        free(setenv_values);
        program = read_spec(&setenv_names, &setenv_values, &setenv_count);
    }
    char *area_end = argv[argc - 1] + strlen(argv[argc - 1]);
    if (argc > 1 && !server_mode)
        memset(argv[1], 0, (size_t)(area_end - argv[1]));

    /* Signals: a few ignored, the ones it acts on blocked and read through a signalfd. SIGCHLD must
     * not stay ignored if the parent left it so, or the kernel would reap children for us. */
    static const int ignored[] = {SIGINT, SIGQUIT, SIGHUP, SIGPIPE, SIGTERM, SIGTSTP, SIGTTIN, SIGTTOU};
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_IGN;
    for (size_t k = 0; k < sizeof ignored / sizeof ignored[0]; k++)
        sigaction(ignored[k], &sa, NULL);
    if (detach_mode)
        sigaction(SIGXFSZ, &sa, NULL); /* a lowered RLIMIT_FSIZE fails a record's write, not us */
    sa.sa_handler = SIG_DFL;
    sigaction(SIGCHLD, &sa, NULL);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGUSR1);
    sigaddset(&mask, SIGUSR2);
    if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0)
        die("sigprocmask: %s", strerror(errno));
    sig_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sig_fd < 0)
        die("signalfd: %s", strerror(errno));

    if (server_mode) {
        if (die_with_parent) {
            pid_t parent = getppid();
            if (prctl(PR_SET_PDEATHSIG, SIGUSR2, 0, 0, 0) < 0)
                die("prctl(PR_SET_PDEATHSIG): %s", strerror(errno));
            if (getppid() != parent)
                die("the parent is already gone");
        }
        free(program);
        program = fork_server(); /* from here on: the child of one request, its command's supervisor */
        die_with_parent = 1;     /* its parent is the fork server, which ends with the harness */
        if (program_cwd != NULL && chdir(program_cwd) < 0) {
            record("cwdfail %d", errno);
            record("exit 127");
            record("empty");
            flush_status();
            return 0;
        }
    }

    if (detach_mode) {
        /* The subreaper must be the long-lived process: everything from here on is in the child. */
        detach(status_path, stdio_paths, stdio_files);
        record("supervisor %d %llu", (int)getpid(), own_start_time());
        if (record_seq == 0)
            die("cannot write the status file: %s", strerror(errno));
    }
    if (!server_mode) {
        /* A spare did this before it took its request (and set its PDEATHSIG there). */
        prepare_supervisor();
        if (die_with_parent) {
            pid_t parent = getppid();
            if (prctl(PR_SET_PDEATHSIG, SIGUSR2, 0, 0, 0) < 0)
                die("prctl(PR_SET_PDEATHSIG): %s", strerror(errno));
            if (getppid() != parent)
                die("the parent is already gone");
        }
    }
    if (subreaper_errno != 0) {
        if (!allow_no_subreaper)
            die("prctl(PR_SET_CHILD_SUBREAPER): %s", strerror(subreaper_errno));
        record("warning no-subreaper %d", subreaper_errno);
    }
    if (proc_fd < 0)
        die("cannot open /proc: %s", strerror(proc_errno));
    if (dev_null < 0)
        die("cannot open /dev/null: %s", strerror(dev_null_errno));
    /* --frame: the command's stdin, stdout and stderr, [0] its read end, [1] its write end. All
     * close-on-exec: the child dup2()s its own ends onto 0-2 and inherits none of the others. */
    int stdio_pipe[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
    char slave[64];
    int pty_err = 0; /* a terminal was asked for and could not be made: this errno */
    if (frame_mode && tty_rows > 0) {
        pty_err = open_terminal(slave, sizeof slave);
    } else if (frame_mode) {
        for (int k = 0; k < 3; k++)
            if (pipe2(stdio_pipe[k], O_CLOEXEC) < 0)
                die("pipe2: %s", strerror(errno));
    }
    if (detach_mode) {
        /* The harness's channel (fds 0-2) closes once the parent exits: the supervisor holds none
         * of it. Then the parent may go; from here on the status file is the only channel. */
        for (int fd = 0; fd <= 2; fd++)
            if (dup2(dev_null, fd) < 0)
                die("dup2: %s", strerror(errno));
        char ready = '\0';
        if (write(ready_fd, &ready, 1) != 1)
            die("cannot tell the parent: %s", strerror(errno));
        close(ready_fd);
        ready_fd = -1;
        /* --cap-bytes: the command writes pipes, the supervisor its files (see relay()). */
        for (int k = 0; k < 2 && cap_bytes >= 0; k++) {
            int relay_ends[2];
            if (pipe2(relay_ends, O_CLOEXEC) < 0 || fcntl(relay_ends[0], F_SETFL, O_NONBLOCK) < 0)
                die("pipe2: %s", strerror(errno));
            relay_file[k] = stdio_files[k + 1];
            relay_pipe[k] = relay_ends[0];
            stdio_files[k + 1] = relay_ends[1]; /* the command's; closed here once it is spawned */
        }
    }
    /* The command's environment: the request's (--fork-server) or ours, with each --setenv. */
    char **command_env = command_environment(program_env != NULL ? program_env : environ, setenv_names,
                                             setenv_values, setenv_count);
    /* posix_spawn: a clone that shares this process's memory until the exec (no page tables copied,
     * which a fork of even this small process costs on every command). Every fd of ours is
     * close-on-exec; the child gets default dispositions for what we ignore, an empty mask, and a
     * session of its own. */
    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attr;
    sigset_t all, none;
    sigfillset(&all);
    sigemptyset(&none);
    if (posix_spawn_file_actions_init(&actions) != 0 || posix_spawnattr_init(&attr) != 0 ||
        posix_spawnattr_setsigdefault(&attr, &all) != 0 || posix_spawnattr_setsigmask(&attr, &none) != 0 ||
        posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK) != 0)
        die("posix_spawn attributes: out of memory");
    for (int k = 0; k < 3 && pty_master < 0; k++) {
        int from = detach_mode ? stdio_files[k] : frame_mode ? stdio_pipe[k][k == 0 ? 0 : 1] : -1;
        /* Over the harness's stream (--frame): from here on the command reaches it only through us. */
        if (from >= 0 && posix_spawn_file_actions_adddup2(&actions, from, k) != 0)
            die("posix_spawn file actions: out of memory");
    }
    /* Status-fd and fork-server mode: a command whose stdin is a terminal gets it as its controlling
     * terminal (Ctrl-C, job control, /dev/tty), as a login shell does. Opening it anew does that: the
     * child leads a new session by now (setsid runs before the file actions in glibc and musl), and a
     * session leader without one acquires the first terminal it opens without O_NOCTTY. A terminal
     * that is already another session's is not taken (the open just succeeds). */
    if (!frame_mode && !detach_mode && isatty(0) &&
        posix_spawn_file_actions_addopen(&actions, 0, "/proc/self/fd/0", O_RDWR, 0) != 0)
        die("posix_spawn file actions: out of memory");
    /* The terminal: the child, a session leader by now (glibc and musl run setsid before the file
     * actions), opens the slave without O_NOCTTY, which makes it the session's controlling terminal
     * and the child's process group its foreground group. Only the child ever opens the slave: once
     * every process closed it, the master reads EIO, the terminal's EOF. */
    if (pty_master >= 0 && (posix_spawn_file_actions_addopen(&actions, 0, slave, O_RDWR, 0) != 0 ||
                            posix_spawn_file_actions_adddup2(&actions, 0, 1) != 0 ||
                            posix_spawn_file_actions_adddup2(&actions, 0, 2) != 0))
        die("posix_spawn file actions: out of memory");
    if (program_status_fd >= 0 && posix_spawn_file_actions_adddup2(&actions, status_fd, program_status_fd) != 0)
        die("posix_spawn file actions: out of memory");
    if (program_status_fd >= 0)
        flush_status(); /* our pid and pidfd first: the program writes records of its own there */
    char **own_env = environ;
    environ = command_env; /* what posix_spawnp searches PATH with, as Popen(env=) does */
    int exec_err =
        pty_err != 0 ? pty_err : posix_spawnp(&child_pid, program[0], &actions, &attr, program, command_env);
    environ = own_env;
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (exec_err != 0)
        child_pid = -1; /* posix_spawn reaped it already */
    for (int k = 0; k < 3; k++)
        if (stdio_files[k] >= 0)
            close(stdio_files[k]); /* the command's alone: no EOF of theirs waits for the supervisor */
    if (frame_mode && tty_rows == 0) {
        close(stdio_pipe[0][0]);
        close(stdio_pipe[1][1]);
        close(stdio_pipe[2][1]);
        stdin_fd = stdio_pipe[0][1];
        streams[0].fd = stdio_pipe[1][0];
        streams[1].fd = stdio_pipe[2][0];
    }
    if (frame_mode) {
        /* Only the supervisor's ends (their own open files): the command's ends stay blocking. The
         * master's dups share one open file: the command's slave is another. */
        int own[3] = {stdin_fd, streams[0].fd, streams[1].fd};
        for (int k = 0; k < 3; k++)
            if (own[k] >= 0 && fcntl(own[k], F_SETFL, O_NONBLOCK) < 0)
                die("fcntl(O_NONBLOCK): %s", strerror(errno));
        /* One slow reader of fd 1 must never stall kill requests; fd 0 too, which may share its open
         * file (one socket as both). This changes the flags of the harness's open file descriptions. */
        int fl0 = fcntl(0, F_GETFL), fl1 = fcntl(1, F_GETFL);
        if (fl0 < 0 || fl1 < 0 || fcntl(0, F_SETFL, fl0 | O_NONBLOCK) < 0 ||
            fcntl(1, F_SETFL, fl1 | O_NONBLOCK) < 0)
            die("fcntl(O_NONBLOCK) on fds 0 and 1: %s", strerror(errno));
        requests_open = 1;
    }
    /* The command's stdin, stdout and stderr are its own: held here, its output would never reach
       EOF while the supervisor waits for leftovers. From now on the status fd is the only channel. */
    for (int fd = frame_mode ? 2 : 0; fd <= 2; fd++)
        if (fd != status_fd && fd != control_fd)
            dup2(dev_null, fd);
    close(dev_null);
    if (pty_err != 0) {
        record("ptyfail %d", pty_err); /* no devpts where the supervisor runs, say */
        record("exit 127");
    } else if (exec_err != 0) {
        record("execfail %d", exec_err);
        record("exit 127"); /* as a child that failed its exec and exited 127 (posix_spawn reaped it) */
    } else {
        record("started %d", (int)child_pid);
        /* What the command's input is, as stat(2) of a reader's fd shows it: taken once, while the
         * terminal's slave surely exists and before the pipe could be closed. */
        struct stat st;
        if (frame_mode && pty_master >= 0 && stat(slave, &st) == 0 && st.st_rdev != 0) {
            input_is_terminal = 1;
            input_dev = st.st_rdev;
            input_known = 1;
        } else if (frame_mode && pty_master < 0 && stdin_fd >= 0 && fstat(stdin_fd, &st) == 0) {
            input_dev = st.st_dev;
            input_ino = st.st_ino;
            input_known = 1;
        }
        /* Says that this supervisor samples, so the harness can tell "not waiting" from "cannot tell". */
        if (input_sampled() && frame_out('s', "input busy 0", 12, RING_CAP))
            input_waiting = 0;
        next_sample = now_ms() + SAMPLE_MS;
    }
    /* A terminal is one stream: the command's stderr is its stdout, so stderr ends at once. */
    if (frame_mode && tty_rows > 0) {
        if (streams[0].fd < 0)
            frame_out('o', NULL, 0, RING_CAP);
        frame_out('e', NULL, 0, RING_CAP);
    }

    struct pollfd pfds[7];
    int killing = 0, pause_ms = PASS_MIN_MS;
    int no_children = 0, finished = 0;
    long long next_pass = 0;
    for (;;) {
        if (!no_children && reap()) {
            no_children = 1;
            for (int k = 0; k < 2; k++) {
                int queued = 0;
                if (streams[k].fd >= 0 && ioctl(streams[k].fd, FIONREAD, &queued) == 0)
                    streams[k].budget = queued;
            }
            /* The terminal's output may still wait in the kernel's buffers beyond the 4 KiB that
             * FIONREAD counts (a read moves it on); a read that finds nothing (EAGAIN) or EIO ends it
             * anyway, so the budget only bounds a writer outside the subtree that holds the slave. */
            if (pty_master >= 0 && streams[0].fd >= 0)
                streams[0].budget += TTY_SLACK;
        }
        if (no_children && (relay_pipe[0] >= 0 || relay_pipe[1] >= 0)) {
            /* No writer is left: what the pipes hold is all there is; `empty` waits for it. */
            want_term = want_kill = killing = 0;
        } else if (no_children) {
            if (!frame_mode) {
                record("empty");
                flush_status();
                return 0;
            }
            if (!finished)
                finished = finish_streams();
            flush_out();
            if (finished && ring_len == 0)
                return 0;
            /* finish_streams stopped at a full buffer, and that flush made room: read on now. The
             * streams are not polled any more, so waiting here could wait for ever once the flush
             * took all (a reader with a large pipe takes the whole buffer at once). */
            if (!finished && ring_len < OUT_LIMIT)
                continue;
            /* `empty` is the last frame: no request is served once it is due. */
            want_term = want_kill = killing = 0;
        }
        if (want_term) {
            int alive;
            want_term = 0;
            record("signalled %d", kill_pass(SIGTERM, &alive));
        }
        if (want_kill) {
            int alive;
            want_kill = 0;
            record("signalled %d", kill_pass(SIGKILL, &alive));
            killing = alive > 0;
            pause_ms = PASS_MIN_MS;
            next_pass = now_ms() + pause_ms;
            continue; /* reap what died before waiting */
        }
        /* The next SIGKILL pass is due by the clock, however busy SIGCHLD keeps the loop. */
        if (killing && now_ms() >= next_pass) {
            int alive;
            kill_pass(SIGKILL, &alive);
            killing = alive > 0;
            if (pause_ms < PASS_MAX_MS)
                pause_ms = pause_ms * 2 > PASS_MAX_MS ? PASS_MAX_MS : pause_ms * 2;
            next_pass = now_ms() + pause_ms;
            continue;
        }
        int nfds = 0, at_control = -1, at_requests = -1, at_stdin = -1, at_out = -1, at_stream[2] = {-1, -1};
        pfds[nfds].fd = sig_fd;
        pfds[nfds++].events = POLLIN;
        if (control_fd >= 0) {
            at_control = nfds;
            pfds[nfds].fd = control_fd;
            pfds[nfds++].events = POLLIN;
        }
        int relay_full = 0;
        for (int k = 0; k < 2; k++) {
            if (relay_pipe[k] < 0)
                continue;
            if (relay(k)) {
                relay_full = 1;
            } else if (relay_pipe[k] >= 0) {
                at_stream[k] = nfds;
                pfds[nfds].fd = relay_pipe[k];
                pfds[nfds++].events = POLLIN;
            }
        }
        if (no_children && relay_pipe[0] < 0 && relay_pipe[1] < 0 && cap_bytes >= 0)
            continue; /* the last output just reached its file: `empty` is due, nothing to wait for */
        if (frame_mode) {
            /* Written before waiting: most of the time nothing is left to wait for. */
            write_stdin();
            report_drained(); /* so at most one a round, whichever write emptied the queue */
            flush_out();
            if (requests_open) {
                at_requests = nfds;
                pfds[nfds].fd = 0;
                pfds[nfds++].events = POLLIN;
            }
            for (int k = 0; k < 2 && !no_children && ring_len < OUT_LIMIT; k++) {
                if (streams[k].fd >= 0) {
                    at_stream[k] = nfds;
                    pfds[nfds].fd = streams[k].fd;
                    pfds[nfds++].events = POLLIN;
                }
            }
            if (stdin_fd >= 0 && stdin_len > 0) {
                at_stdin = nfds;
                pfds[nfds].fd = stdin_fd;
                pfds[nfds++].events = POLLOUT;
            }
            if (ring_len > 0) {
                at_out = nfds;
                pfds[nfds].fd = out_fd();
                pfds[nfds++].events = POLLOUT;
            }
        }
        int timeout = relay_full ? RELAY_WAIT_MS : -1;
        if (killing) {
            long long left = next_pass - now_ms();
            timeout = left < 0 ? 0 : (int)left;
            if (relay_full && timeout > RELAY_WAIT_MS)
                timeout = RELAY_WAIT_MS;
        }
        if (frame_mode && !no_children && input_sampled()) {
            long long left = next_sample - now_ms();
            if (left <= 0) {
                sample_input();
                flush_out(); /* a record a poll for POLLOUT above did not expect yet */
                left = SAMPLE_MS;
                if (ring_len > 0 && at_out < 0) {
                    at_out = nfds;
                    pfds[nfds].fd = out_fd();
                    pfds[nfds++].events = POLLOUT;
                }
            }
            if (timeout < 0 || timeout > left)
                timeout = (int)left;
        }
        flush_status();
        int r = poll(pfds, (nfds_t)nfds, timeout);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("poll: %s", strerror(errno));
        }
        if (r == 0)
            continue; /* a pass is due, or a full file may have room again */
        if (pfds[0].revents & POLLIN) {
            struct signalfd_siginfo si[16];
            ssize_t n;
            while ((n = read(sig_fd, si, sizeof si)) > 0) {
                for (size_t k = 0; k < (size_t)n / sizeof si[0]; k++) {
                    if (si[k].ssi_signo == SIGUSR1)
                        want_term = 1;
                    else if (si[k].ssi_signo == SIGUSR2)
                        want_kill = 1;
                }
            }
            /* A killed task's output is of no use to anyone: it must not keep the supervisor. */
            if (want_kill)
                relay_drop[0] = relay_drop[1] = 1;
        }
        if (at_control >= 0 && pfds[at_control].revents) {
            char buf[64];
            ssize_t n = read(control_fd, buf, sizeof buf);
            if (n > 0) {
                for (ssize_t k = 0; k < n; k++) {
                    if (buf[k] == 'T')
                        want_term = 1;
                    else if (buf[k] == 'K')
                        want_kill = 1;
                }
            } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                /* The harness is gone: nobody is left to ask, so kill everything. */
                control_fd = -1;
                want_kill = 1;
            }
        }
        if (at_requests >= 0 && pfds[at_requests].revents)
            read_requests();
        for (int k = 0; k < 2; k++)
            if (frame_mode && at_stream[k] >= 0 && pfds[at_stream[k]].revents && streams[k].fd >= 0 &&
                ring_len < OUT_LIMIT)
                read_stream(&streams[k], READ_SIZE);
        if (at_stdin >= 0 && pfds[at_stdin].revents)
            write_stdin();
        if (at_out >= 0 && pfds[at_out].revents)
            flush_out();
    }
}
