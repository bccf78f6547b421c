/* The status channel: the records of the plain and fork-server modes as lines on the status fd, or
 * wherever a mode sent them (record_to), and die(), which says why the supervisor gives up. */
#include "common.h"

int status_fd = -1;
static void (*record_sink)(const char *text, size_t n);
static int die_fd = -1;
/* --status-fd: records wait here until the supervisor is about to block (or exit), so that those of
 * one moment (`exit` and `empty`, most often) reach the harness in one write and wake it once. */
static char status_out[4096];
static size_t status_out_len;
/* --fork-server: the supervisor's pid and a pidfd of it go with the first records it sends. */
static int answer_pidfd = -1;
static pid_t answer_pid;

void record_to(void (*sink)(const char *text, size_t n))
{
    record_sink = sink;
}

void die_to(int fd)
{
    die_fd = fd;
}

void answer_with_pidfd(pid_t pid, int pidfd)
{
    answer_pid = pid;
    answer_pidfd = pidfd;
}

/* Says why on stderr (or to the waiting parent: die_to) and exits 125. */
void die(const char *fmt, ...)
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
    if (die_fd >= 0) {
        /* --detach, not ready yet: the waiting parent says it on the harness's stderr and exits 125. */
        if (write(die_fd, buf, (size_t)n) < 0) {
            /* the parent sees EOF and says the supervisor failed */
        }
        exit(EXIT_SETUP);
    }
    if (write(2, "dsh-supervise: ", 15) < 0 || write(2, buf, (size_t)n) < 0) {
        /* nothing left to tell */
    }
    exit(EXIT_SETUP);
}

/* One sendmsg(2) of IOV on FD, with PASSFD attached (SCM_RIGHTS) when it is >= 0. */
ssize_t send_with_fd(int fd, struct iovec *iov, int iovcnt, int passfd, int flags)
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

/* Writes the records that wait (with the pidfd answer, the first time) in one go. */
void flush_status(void)
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

/* One status record: one line, one write(2) (or what record_to made of it: one frame, one signed
 * line). Failures (a reader that left, a full file system) are ignored. */
void record(const char *fmt, ...)
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
    if (record_sink != NULL) {
        record_sink(buf, (size_t)n);
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
    fd = 2; /* only warnings are worth saying without a status fd */
    if (strncmp(buf, "warning ", 8) != 0)
        return;
    ssize_t w;
    do
        w = write(fd, buf, (size_t)n);
    while (w < 0 && errno == EINTR);
}

/* Reads exactly N bytes from FD, waiting on it if it is non-blocking. 0 when all N came. */
int read_exact(int fd, unsigned char *buf, size_t n)
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

int write_exact(int fd, const void *buf, size_t n)
{
    const char *at = buf;
    while (n > 0) {
        ssize_t w = write(fd, at, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        at += w;
        n -= (size_t)w;
    }
    return 0;
}

long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
