/* What every part of dsh-supervise shares: the system headers, the exit codes, and the status channel
 * (die, record) that each mode points where its records go. */
#ifndef DSH_COMMON_H
#define DSH_COMMON_H

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

#define VERSION "13"
#define EXIT_SETUP 125
#define READ_SIZE 65536 /* one read of a command pipe, or of fd 0; the largest payload sent */

/* status.c: the status records. status_fd is the plain mode's --status-fd, a fork-server request's
 * status socket, or --detach's status file; -1 in frame mode. */
extern int status_fd;
void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void record(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void flush_status(void);
/* Where a mode's records go instead of the status-fd lines: TEXT without its newline. */
void record_to(void (*sink)(const char *text, size_t n));
/* --detach, until its supervisor is ready: die() tells the waiting parent through FD. */
void die_to(int fd);
/* --fork-server: PID and a pidfd of it go with the first records (`pidfd PID`). */
void answer_with_pidfd(pid_t pid, int pidfd);
ssize_t send_with_fd(int fd, struct iovec *iov, int iovcnt, int passfd, int flags);
int read_exact(int fd, unsigned char *buf, size_t n);
/* All of BUF to FD (a blocking one): 0, or -1 with errno set. */
int write_exact(int fd, const void *buf, size_t n);
long long now_ms(void);

#endif
