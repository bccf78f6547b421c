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
 *
 * Before it says ready it puts a sealed copy of itself (a memfd no process can write, grow or shrink)
 * on fd 4, which BASH inherits: BOOT execs the command's supervisor from it (--self-fd 4) rather than
 * from the cached file, which a process of the login may write or replace. This binary was checked
 * before its exec (the warm line compares the file's identity), and the copy is what runs here (the
 * kernel refuses writes to a running executable). Without memfds or seals fd 4 is left closed and BOOT
 * checks the file as a cold channel does.
 */
#include "common.h"
#include "supervisor.h"

#define LENGTH_DIGITS 10
#define MAX_REQUEST (1LL << 30)
/* Where BASH finds the sealed copy of this binary (BOOT's --self-fd). */
#define SELF_FD 4

#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif
/* Linux 6.3+: say the memfd is meant to be executable (else the kernel logs a warning, and refuses
 * the exec where vm.memfd_noexec is 2); older kernels refuse the flag (EINVAL): then without it. */
#ifndef MFD_EXEC
#define MFD_EXEC 0x0010U
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#define F_SEAL_WRITE 0x0008
#endif

#ifndef SYS_memfd_create
#error "memfd_create(2) is needed for --warm"
#endif

static void write_all(int fd, const char *buf, size_t n)
{
    if (write_exact(fd, buf, n) != 0)
        die("--warm: cannot write: %s", strerror(errno));
}

/* A sealed copy of /proc/self/exe on SELF_FD, or SELF_FD closed: see above. */
static void seal_a_copy_of_self(void)
{
    close(SELF_FD); /* whatever the login shell left there is not this binary */
    int exe = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (exe < 0)
        return;
    int fd = (int)syscall(SYS_memfd_create, "dsh-supervise", MFD_ALLOW_SEALING | MFD_EXEC);
    if (fd < 0 && errno == EINVAL)
        fd = (int)syscall(SYS_memfd_create, "dsh-supervise", MFD_ALLOW_SEALING);
    int copied = fd >= 0;
    char buf[65536];
    while (copied) {
        ssize_t n = read(exe, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            copied = n == 0;
            break;
        }
        copied = write_exact(fd, buf, (size_t)n) == 0;
    }
    close(exe);
    if (copied && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) == 0
        && (fd == SELF_FD || dup2(fd, SELF_FD) == SELF_FD)) {
        if (fd != SELF_FD)
            close(fd);
        return;
    }
    if (fd >= 0)
        close(fd);
    close(SELF_FD);
}

int run_warm(const char *bash)
{
    seal_a_copy_of_self();
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
