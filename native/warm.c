/*
 * --warm BASH (version 7): the waiter of an SSH login's warm channel.
 *
 * A warm channel is opened and logged in ahead of the next command, whose request (its arguments, its
 * whole environment, BOOT) it then waits for on fd 0. A bash waiting there is any process of the same
 * user's to take over: it can open that bash's /proc/PID/fd/0 and /proc/PID/fd/1 (or ptrace it), read
 * the next command's request, secrets and all, and answer in its place. This process waits instead:
 * non-dumpable from the start of main, so no process of the user can open its fds, read its memory or
 * its environment (the login's), nor ptrace it.
 *
 * It writes the ready marker ("\0dsh-bash-ready\0") to fd 1, reads one request from fd 0 (ten decimal
 * digits, then that many bytes; never a byte past it: the command's stdin follows on fd 0), puts it in
 * a memfd on fd 3 and execs BASH --noprofile --norc -c 'builtin . /proc/self/fd/3' dsh-bash with an
 * empty environment. The request is never on a command line; its first line closes fd 3. At EOF, or on
 * a length that is not ten digits or is above 1 GiB, it exits 0 having run nothing (the channel closed
 * unused, or something else wrote to it).
 */
#include "common.h"
#include "supervisor.h"

#define LENGTH_DIGITS 10
#define MAX_REQUEST (1LL << 30)

#ifndef SYS_memfd_create
#error "memfd_create(2) is needed for --warm"
#endif

static void write_all(int fd, const char *buf, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            die("--warm: cannot write: %s", strerror(errno));
        buf += w;
        n -= (size_t)w;
    }
}

int run_warm(const char *bash)
{
    static const char ready[] = "\0dsh-bash-ready"; /* with its terminating NUL: the marker's 16 bytes */
    write_all(1, ready, sizeof ready);

    unsigned char digits[LENGTH_DIGITS];
    if (read_exact(0, digits, sizeof digits) != 0)
        return 0;
    long long len = 0;
    for (size_t k = 0; k < sizeof digits; k++) {
        if (digits[k] < '0' || digits[k] > '9')
            return 0;
        len = len * 10 + (digits[k] - '0');
    }
    if (len > MAX_REQUEST)
        return 0;
    char *body = malloc((size_t)len + 1);
    if (body == NULL)
        die("--warm: out of memory for a request of %lld bytes", len);
    if (read_exact(0, (unsigned char *)body, (size_t)len) != 0)
        return 0;

    int fd = (int)syscall(SYS_memfd_create, "dsh-bash-request", 0);
    if (fd < 0)
        die("--warm: memfd_create: %s", strerror(errno));
    write_all(fd, body, (size_t)len);
    free(body);
    if (lseek(fd, 0, SEEK_SET) != 0)
        die("--warm: lseek: %s", strerror(errno));
    if (fd != 3) {
        if (dup2(fd, 3) < 0)
            die("--warm: dup2: %s", strerror(errno));
        close(fd);
    }
    char *argv[] = {(char *)bash, "--noprofile", "--norc", "-c", "builtin . /proc/self/fd/3", "dsh-bash", NULL};
    char *envp[] = {NULL};
    execve(bash, argv, envp);
    die("--warm: cannot exec %s: %s", bash, strerror(errno));
}
