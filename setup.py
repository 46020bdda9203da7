"""Packaging for shardkit, nbdev 2 style: every setting comes from settings.ini."""
from configparser import ConfigParser
import setuptools, shlex

config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

expected = 'version description keywords author author_email'.split()
missing = [o for o in expected if o not in cfg]
if missing: raise ValueError(f"settings.ini is missing {missing}")

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12'.split()

requirements = shlex.split(cfg.get('requirements', ''))
# optional extras: settings.ini key `<extra>_requirements` -> pip install "shardkit[<extra>]"; `dev` also takes in
# every extra named in `dev_extras`
extras = {k: shlex.split(cfg.get(f'{k}_requirements', '')) for k in ('lab', 'docs', 'dask', 'peers', 's3', 'gcs', 'azure')}
dev_requirements = shlex.split(cfg.get('dev_requirements', ''))
extras['dev'] = list(dict.fromkeys([r for k in cfg.get('dev_extras', '').split() for r in extras[k]] + dev_requirements))
# The crop-window JPEG decoder (shardkit/native/jpeg_window.c), built where a C compiler and libjpeg's headers are.
# shardkit loads it with ctypes (it is no Python module), so only its one function is exported. Optional: where it
# cannot be built the install goes on, and shardkit builds it at first use into SHARDKIT_HOME/native or decodes
# whole images (shardkit.loading.jpeg.why_no_window_decode() says why).
jpeg_window = setuptools.Extension('shardkit.native._jpeg_window', ['shardkit/native/jpeg_window.c'], libraries=['jpeg', 'm'],
                                   extra_compile_args=['-O2', '-fvisibility=hidden'], optional=True)
lic = licenses[cfg['license']]
min_python = cfg['min_python']

setuptools.setup(
    name=cfg['lib_name'],
    license=lic[0],
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'License :: ' + lic[1],
                 'Natural Language :: ' + cfg['language'].title()]
                + ['Programming Language :: Python :: ' + o for o in py_versions[py_versions.index(min_python):]],
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=['shardkit', 'shardkit.*']),
    include_package_data=True,
    # the source the runtime build compiles and its check's pixels; every command's --help, kept (shardkit.apps.cli)
    package_data={'shardkit.native': ['*.c', '*.npz'], 'shardkit.apps': ['command_help.json']},
    ext_modules=[jpeg_window],
    install_requires=requirements,
    extras_require=extras,
    dependency_links=cfg.get('dep_links', '').split(),
    python_requires='>=' + min_python,
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'console_scripts': cfg.get('console_scripts', '').split(),
                  'nbdev': [f'{cfg["lib_path"]}={cfg["lib_path"]}._modidx:d']},
    version=cfg['version'],
    description=cfg['description'],
    author=cfg['author'],
    author_email=cfg['author_email'],
    keywords=cfg['keywords'],
)
