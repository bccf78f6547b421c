/* The pseudo-terminal of frame mode (protocol: framed.c's header). */
#include "common.h"
#include "pty.h"

static int pty_master = -1;

int pty_active(void)
{
    return pty_master >= 0;
}

/* "R<SEP>C" in N bytes: two decimal numbers of 1 to 65535 (what a struct winsize holds), nothing else.
 * 0 when sound. */
int parse_size(const char *s, size_t n, char sep, unsigned short *rows, unsigned short *cols)
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
void pty_resize(const unsigned char *text, size_t len, size_t cap)
{
    unsigned short rows, cols;
    if (pty_master < 0)
        return;
    if (len > cap ||
        parse_size((const char *)text, len, ' ', &rows, &cols) != 0) {
        record("warning resize %d", EINVAL);
        return;
    }
    struct winsize ws = {rows, cols, 0, 0};
    if (ioctl(pty_master, TIOCSWINSZ, &ws) < 0)
        record("warning resize %d", errno);
}

/* Makes the pseudo-terminal (master here, close-on-exec, never our controlling terminal) of the asked
 * size and names its slave, which only the child opens. Returns 0, or the errno that failed it. */
int pty_open(unsigned short rows, unsigned short cols, char *slave, size_t size, int *in_fd, int *out_fd)
{
    int fd = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    struct winsize ws = {rows, cols, 0, 0};
    int err = 0;
    if (grantpt(fd) < 0 || unlockpt(fd) < 0 || ioctl(fd, TIOCSWINSZ, &ws) < 0)
        err = errno;
    else
        err = ptsname_r(fd, slave, size);
    /* Three descriptors of one open file: the 'i' queue and the output stream close on their own
     * (input broken, EOF), while 'W' still needs one. */
    if (err == 0 && ((*in_fd = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0 ||
                     (*out_fd = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0))
        err = errno;
    if (err != 0) {
        if (*in_fd >= 0)
            close(*in_fd);
        close(fd);
        *in_fd = *out_fd = -1;
        return err;
    }
    pty_master = fd;
    return 0;
}
