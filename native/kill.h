/* The supervisor's subtree as /proc shows it: finding every descendant and signalling it (kill.c),
 * and the few /proc readers the input sampler (waiting.c) shares. */
#ifndef DSH_KILL_H
#define DSH_KILL_H

#include <sys/types.h>

enum { STAT_OK = 0, STAT_GONE = -1, STAT_NOFD = -2 };

extern int proc_fd;    /* /proc, opened by proc_init */
extern pid_t self_pid; /* the supervisor: the root of the subtree */
extern int tids[4096]; /* read_tids' answer */
extern unsigned stat_tty; /* read_stat's: the controlling terminal's tty_nr */

/* Takes this process as the subtree's root and opens /proc: 0, or the errno that failed it. */
int proc_init(void);
int read_stat(int pid, int *ppid, char *state);
int read_tids(int pid, int *ntids);
/* One pass of SIG over the whole subtree: how many were signalled; *alive counts the live ones. */
int kill_pass(int sig, int *alive);

#endif
