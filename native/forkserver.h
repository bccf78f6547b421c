#ifndef DSH_FORKSERVER_H
#define DSH_FORKSERVER_H

#include <stddef.h>

/* A request's payload, as --fork-server takes it and --spec's 'x' frame carries it. */
struct request {
    char **argv;
    char **env; /* the command's whole environment */
    char *cwd;
    int status_to; /* >= 3: the program gets the status socket as this fd too; -1: it does not */
};

/* Splits DATA (LEN bytes of NUL-terminated strings: the working directory, the status fd, the argument
 * count, the arguments, then the environment) into REQ. 0 when it is sound. */
int parse_request(char *data, size_t len, struct request *req);

#endif
