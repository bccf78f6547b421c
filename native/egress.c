/*
 * egress.c: the network allow-list's side of --confine (docs/design/policy.md; version 11, --proxy
 * PATH 12, --proxy-key-env 13): the connection to the harness's egress proxy, the proxy's key, and the
 * forwarder in the command's own network with its relays. confine.c says what the rule is.
 */
#include "common.h"
#include "egress.h"
#include <dirent.h>
#include <netinet/in.h>
#include <stddef.h>
#include <sys/un.h>

#define PROXY_PORT 3128 /* dsh_bash._egress.PROXY_PORT */

/* The harness's egress proxy, reached before the command's network is made. @NAME: an abstract unix
 * socket, which exists in the harness's network namespace only, so no process in the command's own
 * network can reach it later; this one connection (one per command) is all it gets (returned). PATH:
 * a unix socket's file, connected to per connection by the forwarder's relays; only looked at here
 * (-1 is returned), so that a proxy that is not there fails the step, not each connection later. */
int connect_proxy(const char *name)
{
    struct sockaddr_un proxy = {.sun_family = AF_UNIX};
    size_t length = strlen(name);
    if (name[0] == '/') {
        struct stat seen;
        if (length >= sizeof proxy.sun_path)
            die("--confine: --proxy %s: a unix socket's path is at most %zu bytes", name, sizeof proxy.sun_path - 1);
        if (stat(name, &seen) < 0)
            die("--confine: --proxy %s: cannot reach the egress proxy: %s", name, strerror(errno));
        if (!S_ISSOCK(seen.st_mode))
            die("--confine: --proxy %s: cannot reach the egress proxy: not a socket", name);
        return -1;
    }
    if (name[0] != '@' || length < 2 || length > sizeof proxy.sun_path)
        die("--confine: --proxy wants an abstract unix socket's name (@NAME) or a socket's absolute path, not '%s'",
            name);
    memcpy(proxy.sun_path + 1, name + 1, length - 1); /* sun_path[0] stays 0: abstract */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t size = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + length);
    if (fd < 0 || connect(fd, (struct sockaddr *)&proxy, size) < 0)
        die("--confine: --proxy %s: cannot reach the egress proxy: %s", name, strerror(errno));
    return fd;
}

/* The proxy's key and its newline (--proxy-key), sent first on each relay's connection; empty: none. */
static char proxy_key[130];
static size_t proxy_key_length;

/* Takes --proxy-key-env NAME's value into proxy_key (hex digits, 16 to 128 of them) and removes the
 * variable from the environment: the command never sees it. */
void take_proxy_key(const char *name)
{
    const char *text = getenv(name);
    if (text == NULL)
        die("--confine: --proxy-key-env %s: the environment has no such variable", name);
    size_t n = strlen(text);
    int hex = n >= 16 && n <= 128;
    for (size_t k = 0; hex && k < n; k++)
        hex = (text[k] >= '0' && text[k] <= '9') || (text[k] >= 'a' && text[k] <= 'f');
    if (!hex)
        die("--confine: --proxy-key-env %s: not a key (16 to 128 lowercase hex digits)", name);
    memcpy(proxy_key, text, n);
    proxy_key[n] = '\n';
    proxy_key_length = n + 1;
    /* In place too: unsetenv drops the pointer, but /proc/PID/environ shows the initial block, which
     * the forwarder keeps (a copy of this process). */
    memset((char *)text, 0, n);
    if (unsetenv(name) < 0)
        die("--confine: --proxy-key-env %s: unsetenv: %s", name, strerror(errno));
}

/* One direction of a relay: what was read from FROM and is not yet written to TO. */
struct relay_direction {
    int from, to;
    size_t length, offset;
    int ended; /* FROM's EOF was read (and passed on as a half close once the buffer is empty) */
    char buffer[64 * 1024];
};

/* Copies CLIENT to a new connection to the proxy's file PATH and back until both directions ended
 * (each end's EOF passed on as a half close); in the relay's own process. Non-blocking both ways: a
 * tunnel whose two ends both send a lot at once must not wait on each other. */
static void relay(int client, const char *path)
{
    struct sockaddr_un there = {.sun_family = AF_UNIX};
    memcpy(there.sun_path, path, strlen(path) + 1); /* connect_proxy checked its length */
    int upstream = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (upstream < 0 || connect(upstream, (struct sockaddr *)&there, sizeof there) < 0)
        _exit(1); /* the client sees its connection closed: the proxy is gone */
    if (proxy_key_length > 0 && write_exact(upstream, proxy_key, proxy_key_length) < 0)
        _exit(1);
    static struct relay_direction way[2];
    way[0] = (struct relay_direction){.from = client, .to = upstream};
    way[1] = (struct relay_direction){.from = upstream, .to = client};
    for (int k = 0; k < 2; k++)
        if (fcntl(way[k].from, F_SETFL, fcntl(way[k].from, F_GETFL) | O_NONBLOCK) < 0)
            _exit(1);
    for (;;) {
        struct pollfd wanted[2];
        for (int k = 0; k < 2; k++) {
            struct relay_direction *d = &way[k];
            short events = d->length > 0 ? POLLOUT : d->ended ? 0 : POLLIN;
            wanted[k] = (struct pollfd){.fd = events ? (d->length > 0 ? d->to : d->from) : -1, .events = events};
        }
        if (wanted[0].fd < 0 && wanted[1].fd < 0)
            _exit(0); /* both ended, everything passed on */
        if (poll(wanted, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            _exit(1);
        }
        for (int k = 0; k < 2; k++) {
            struct relay_direction *d = &way[k];
            if (wanted[k].fd < 0 || wanted[k].revents == 0)
                continue;
            if (d->length > 0) {
                ssize_t put = write(d->to, d->buffer + d->offset, d->length - d->offset);
                if (put < 0 && (errno == EINTR || errno == EAGAIN))
                    continue;
                if (put <= 0)
                    _exit(0); /* the other end went away */
                d->offset += (size_t)put;
                if (d->offset == d->length) {
                    d->length = d->offset = 0;
                    if (d->ended)
                        shutdown(d->to, SHUT_WR);
                }
                continue;
            }
            ssize_t got = read(d->from, d->buffer, sizeof d->buffer);
            if (got < 0 && (errno == EINTR || errno == EAGAIN))
                continue;
            if (got < 0)
                _exit(0);
            if (got == 0) {
                d->ended = 1;
                shutdown(d->to, SHUT_WR);
            } else {
                d->length = (size_t)got;
                d->offset = 0;
            }
        }
    }
}

/* The inode of the socket at the other end of CONN, a TCP connection on loopback, from /proc/net/tcp
 * (the entry whose local address is CONN's peer and whose remote one is CONN's own); 0: not found. */
static unsigned long peer_inode(int conn)
{
    struct sockaddr_in peer, here;
    socklen_t n = sizeof peer, m = sizeof here;
    if (getpeername(conn, (struct sockaddr *)&peer, &n) < 0 || getsockname(conn, (struct sockaddr *)&here, &m) < 0)
        return 0;
    FILE *table = fopen("/proc/net/tcp", "re");
    if (table == NULL)
        return 0;
    char line[512];
    unsigned long found = 0;
    while (found == 0 && fgets(line, sizeof line, table) != NULL) {
        unsigned int local, local_port, remote, remote_port;
        unsigned long inode;
        if (sscanf(line, " %*u: %X:%X %X:%X %*X %*X:%*X %*X:%*X %*X %*u %*u %lu", &local, &local_port, &remote,
                   &remote_port, &inode) == 5 &&
            local == peer.sin_addr.s_addr && local_port == ntohs(peer.sin_port) &&
            remote == here.sin_addr.s_addr && remote_port == ntohs(here.sin_port))
            found = inode;
    }
    fclose(table);
    return found;
}

/* The parent of PID (from /proc/PID/stat), or 0. */
static pid_t parent_of(pid_t pid)
{
    char path[64], text[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    if (got <= 0)
        return 0;
    text[got] = '\0';
    char *end = strrchr(text, ')'); /* the name may hold anything but is followed by ") S PPID" */
    int parent = 0;
    if (end == NULL || sscanf(end + 1, " %*c %d", &parent) != 1)
        return 0;
    return (pid_t)parent;
}

/* Whether a process of the command (one that descends from SUPERVISOR, a subreaper: the command's
 * orphans stay beneath it) holds the socket INODE. Another command's process is not looked at at all
 * where Landlock scopes this one (its descriptors cannot be read): it is refused either way. */
static int held_by_the_command(unsigned long inode, pid_t supervisor)
{
    char wanted[64];
    snprintf(wanted, sizeof wanted, "socket:[%lu]", inode);
    DIR *procs = opendir("/proc");
    if (procs == NULL)
        return 0;
    int held = 0;
    struct dirent *proc;
    while (!held && (proc = readdir(procs)) != NULL) {
        char *end;
        long pid = strtol(proc->d_name, &end, 10);
        if (*end != '\0' || pid <= 0)
            continue;
        char fds_path[64];
        snprintf(fds_path, sizeof fds_path, "/proc/%ld/fd", pid);
        DIR *fds = opendir(fds_path);
        if (fds == NULL)
            continue;
        struct dirent *fd;
        while (!held && (fd = readdir(fds)) != NULL) {
            char link_path[320], target[64];
            snprintf(link_path, sizeof link_path, "%s/%s", fds_path, fd->d_name);
            ssize_t k = readlink(link_path, target, sizeof target - 1);
            if (k > 0) {
                target[k] = '\0';
                if (strcmp(target, wanted) == 0) {
                    for (pid_t up = (pid_t)pid; up > 1 && !held; up = parent_of(up))
                        held = up == supervisor;
                }
            }
        }
        closedir(fds);
    }
    closedir(procs);
    return held;
}

/* A process of the command's (its parent's death ends it) that listens on 127.0.0.1 in the command's
 * network and hands each connection it accepts to the egress proxy over CONTROL (the descriptor
 * itself, SCM_RIGHTS), or (CONTROL -1) to a relay to the proxy's file PATH: the command's one way
 * out. Holds none of the command's descriptors (its output pipes least of all: a background task's
 * end must not wait for it). In the command's own network it listens on PROXY_PORT. A network it
 * shares (a container without one, where no namespace can be made) has the other commands' too: it
 * listens where the kernel says when PROXY_PORT is taken, and serves only connections from this
 * command's processes, so that another command, under a narrower rule, cannot go out through it. */
int start_forwarder(int control, const char *path, int own_network)
{
    int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in here = {.sin_family = AF_INET, .sin_port = htons(PROXY_PORT),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1;
    if (listener < 0 || setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0)
        die("--confine: --proxy: cannot make a socket: %s", strerror(errno));
    if (bind(listener, (struct sockaddr *)&here, sizeof here) < 0) {
        here.sin_port = 0;
        if (own_network || errno != EADDRINUSE || bind(listener, (struct sockaddr *)&here, sizeof here) < 0)
            die("--confine: --proxy: cannot listen on 127.0.0.1:%d: %s", PROXY_PORT, strerror(errno));
    }
    socklen_t size = sizeof here;
    if (listen(listener, 64) < 0 || getsockname(listener, (struct sockaddr *)&here, &size) < 0)
        die("--confine: --proxy: cannot listen on 127.0.0.1: %s", strerror(errno));
    pid_t parent = getpid();
    pid_t supervisor = getppid();
    pid_t pid = fork();
    if (pid < 0)
        die("--confine: --proxy: fork: %s", strerror(errno));
    if (pid > 0) {
        close(listener);
        close(control);
        return ntohs(here.sin_port);
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
        _exit(0);
    prctl(PR_SET_DUMPABLE, 0); /* the key in its memory (and its relays', which inherit this) */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    for (int fd = 0; fd < 3; fd++)
        dup2(null, fd);
    for (int fd = 3; fd < 1024; fd++)
        if (fd != listener && fd != control)
            close(fd);
    signal(SIGCHLD, SIG_IGN); /* the relays reap themselves */
    pid_t forwarder = getpid();
    for (;;) {
        int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE)
                continue;
            _exit(1);
        }
        if (!own_network) {
            unsigned long inode = peer_inode(conn);
            if (inode == 0 || !held_by_the_command(inode, supervisor)) {
                close(conn);
                continue;
            }
        }
        if (control < 0) {
            pid_t relay_pid = fork(); /* refused past a processes limit: that connection is closed */
            if (relay_pid == 0) {
                close(listener);
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                if (getppid() != forwarder)
                    _exit(0);
                relay(conn, path);
            }
            close(conn);
            continue;
        }
        char byte = 'c';
        struct iovec iov = {.iov_base = &byte, .iov_len = 1};
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } space;
        memset(&space, 0, sizeof space);
        struct msghdr message = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = space.buf,
                                 .msg_controllen = sizeof space.buf};
        struct cmsghdr *passed = CMSG_FIRSTHDR(&message);
        passed->cmsg_level = SOL_SOCKET;
        passed->cmsg_type = SCM_RIGHTS;
        passed->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(passed), &conn, sizeof(int));
        ssize_t sent;
        do
            sent = sendmsg(control, &message, MSG_NOSIGNAL);
        while (sent < 0 && errno == EINTR);
        close(conn);
        if (sent < 0)
            _exit(1); /* the proxy is gone (the executor closed): nothing more to forward */
    }
}

/* The variables that send a command's HTTP clients to the forwarder (and their own loopback past it). */
void set_proxy_variables(int port)
{
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    const char *names[] = {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        setenv(names[k], url, 1);
    setenv("NO_PROXY", "localhost,127.0.0.1,::1", 1);
    setenv("no_proxy", "localhost,127.0.0.1,::1", 1);
}
