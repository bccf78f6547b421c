/* confine.c: --confine, the sandbox policy's step (version 10). */
#ifndef DSH_CONFINE_H
#define DSH_CONFINE_H

/* The Landlock ABI of the running kernel; 0 without Landlock. */
int landlock_abi(void);
/* The whole of the mode: restricts this process and execs the program ARGV names; returns only the
 * exit status of --probe. */
int run_confine(int argc, char **argv);

#endif
