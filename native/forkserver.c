/*
 * --fork-server (version 4), one per harness (executor), so that a command costs a fork instead of an
 * exec: fd 0 is a Unix stream socket. The server keeps a spare child ready (announced on fd 0 as
 * `spare PID` with a pidfd attached), which takes the next request from fd 0 and becomes that
 * command's supervisor as in the status-fd mode with --die-with-parent (its parent is the server). A
 * request: a 4-byte big-endian length, then NUL-terminated strings (directory, the fd at which the
 * program gets the status socket too or -1, argument count, arguments, environment entries), with
 * exactly four fds attached (status socket, stdin, stdout, stderr). The supervisor's first message is `pidfd PID` with a pidfd of itself attached, sent with
 * its first records; `cwdfail ERRNO` when the directory cannot be entered. EOF on fd 0 or the
 * server's death ends every supervisor under it (PDEATHSIG SIGUSR2). A malformed request: 125.
 */
#include "common.h"
#include "forkserver.h"
#include "supervisor.h"

#define SERVER_REQUEST_MAX (16 << 20) /* argv + environment: far beyond what execve takes */
#define SERVER_FDS 4                   /* status socket, then the command's stdin, stdout, stderr */
#define EXIT_PROTOCOL 126              /* a spare read what no harness of this version sends */
#define SPARE_DELAY_MS 20              /* after a request was taken, at most this long without a spare */
#define SERVER_END_MS 1500             /* at close: how long the server waits for its supervisors */
#define SPARE_RETRY_MS 50              /* after a fork failed for lack of processes or memory */

/* The request a spare took: what its command runs, and where. */
static struct request taken_request = {NULL, NULL, NULL, -1};

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

int parse_request(char *data, size_t len, struct request *req)
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
    req->status_to = (int)status_to;
    req->cwd = strings[0];
    req->env = envp;
    req->argv = argv;
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

/* A spare of the fork server: waits, ready, for the next request on fd 0 and takes it (then tells the
 * server through TAKEN, so that it forks the next spare). Returns as that command's supervisor, with
 * status_fd and fds 0-2 set and the request in taken_request. */
static void spare(int taken)
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
     * Both go out before the command is spawned (spawn_command flushes them). */
    answer_with_pidfd(getpid(), (int)syscall(SYS_pidfd_open, getpid(), 0));
    if (parse_request(data, len, &taken_request) != 0) {
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
static void fork_server(void)
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
                spare(taken[1]);
                return;
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

int run_fork_server(struct options *o)
{
    take_signals(0);
    if (o->die_with_parent)
        parent_death_signal();
    fork_server(); /* from here on: the child of one request, its command's supervisor */
    struct request *r = &taken_request;
    if (r->cwd != NULL && chdir(r->cwd) < 0) {
        record("cwdfail %d", errno);
        record("exit 127");
        record("empty");
        flush_status();
        return 0;
    }
    check_supervisor(o->allow_no_subreaper);
    struct launch l = {r->argv, command_environment(r->env != NULL ? r->env : environ, o), {-1, -1, -1}, NULL, 1,
                       r->status_to, -1, -1};
    int err = spawn_command(&l);
    settle_stdio(0, -1);
    report_start(0, err);
    struct mode m = {.control_fd = -1, .grace_ms = -1};
    return supervise(&m);
}
