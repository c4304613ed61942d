"""Static files of the web dashboard (served by ``luban.cluster.service``)."""
